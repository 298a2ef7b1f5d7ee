"""Load on the sidecar over loopback.

Starts `blocktune serve` in a subprocess (the default policy, deciding every
`--interval`, with a bearer token), then runs `--posters` clients that POST
batches of `--batch` observations back to back and `--pollers` clients that
GET /v1/recommendation every `--poll-every` seconds (posters go back to
back, or at `--rate` observations per second in all), until `--duration`
seconds or `--max-requests` requests have passed. The clients share one
asyncio loop and a minimal keep-alive HTTP/1.1 client, so the load generator
costs little next to the server. Prints observations per second, p50/p99
latency of both endpoints, failures, and the server's resident memory: at
start, over time (once a second) and its peak (VmHWM).

    python bench/sidecar_load.py [--posters 25] [--pollers 25] [--batch 100]
                                 [--rate 0] [--duration 10] [--max-requests 100000]

Linux only for the memory figures (/proc/PID/status).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import yaml
from result_file import ResultFile, bench_parser

from blocktune.tuner.operations import NotReady, free_port, wait_until_ready

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "bench-token"


class Client:
    """One keep-alive HTTP/1.1 connection: send a request, read a Content-Length response."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, body: bytes = b"") -> int:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\n"
            f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        self.writer.write(head.encode() + body)
        await self.writer.drain()
        status = int((await self.reader.readline()).split()[1])
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
        await self.reader.readexactly(length)
        return status

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            await self.writer.wait_closed()


class Budget:
    """Stops every client at the deadline or after `max_requests` requests in all."""

    def __init__(self, duration_s: float, max_requests: int) -> None:
        self.deadline = time.perf_counter() + duration_s
        self.left = max_requests

    def take(self) -> bool:
        if self.left <= 0 or time.perf_counter() >= self.deadline:
            return False
        self.left -= 1
        return True


async def poster(
    client: Client, bodies: list[bytes], every_s: float, budget: Budget, out: dict
) -> None:
    """POST batches back to back, or one every `every_s` seconds when that is > 0
    (starting at a random phase, so that the posters do not all send at once)."""
    i = 0
    next_at = time.perf_counter() + every_s * random.random()
    await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
    while budget.take():
        body = bodies[i % len(bodies)]
        start = time.perf_counter()
        status = await client.request("POST", "/v1/observations", body)
        out["post_ms"].append((time.perf_counter() - start) * 1e3)
        out["failures"] += status != 200
        out["observations"] += out["batch"] if status == 200 else 0
        i += 1
        next_at += every_s
        if every_s > 0:
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))


async def poller(client: Client, every_s: float, budget: Budget, out: dict) -> None:
    while budget.take():
        start = time.perf_counter()
        status = await client.request("GET", "/v1/recommendation")
        out["get_ms"].append((time.perf_counter() - start) * 1e3)
        out["failures"] += status != 200
        await asyncio.sleep(every_s)


async def drive(port: int, args: argparse.Namespace, bodies: list[bytes]) -> dict:
    out = {"post_ms": [], "get_ms": [], "failures": 0, "observations": 0, "batch": args.batch}
    budget = Budget(args.duration, args.max_requests)
    clients = [Client("127.0.0.1", port) for _ in range(args.posters + args.pollers)]
    post_every = args.posters * args.batch / args.rate if args.rate > 0 else 0.0
    start = time.perf_counter()
    await asyncio.gather(
        *(poster(c, bodies, post_every, budget, out) for c in clients[: args.posters]),
        *(poller(c, args.poll_every, budget, out) for c in clients[args.posters :]),
    )
    out["elapsed_s"] = time.perf_counter() - start
    for client in clients:
        await client.close()
    return out


def make_bodies(batch: int, count: int = 20) -> list[bytes]:
    rng = np.random.default_rng(0)
    bodies = []
    for _ in range(count):
        prompts = rng.lognormal(4.0, 1.0, batch).astype(int) + 1
        outputs = rng.lognormal(3.5, 0.8, batch).astype(int)
        items = [
            {"prompt_tokens": int(p), "output_tokens": int(o)}
            for p, o in zip(prompts, outputs, strict=True)
        ]
        bodies.append(json.dumps(items).encode())
    return bodies


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def sample_rss(pid: int, samples: list[int], stop: threading.Event) -> None:
    while not stop.wait(1.0):
        samples.append(rss_kib(pid))


def start_server(policy: Path, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "blocktune.tuner.cli", "serve", "--policy", str(policy)]
    env = {**os.environ, "BLOCKTUNE_TOKEN": TOKEN}
    process = subprocess.Popen(
        [*command, "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until_ready(f"http://127.0.0.1:{port}", process, timeout_s=60, path="/readyz")
    except NotReady:
        process.kill()
        raise
    return process


def percentiles(values: list[float]) -> str:
    if not values:
        return "n/a"
    p50, p99 = np.percentile(values, [50, 99])
    return f"p50 {p50:6.2f} ms   p99 {p99:6.2f} ms   ({len(values)} requests)"


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--posters", type=int, default=25, help="clients posting observations")
    parser.add_argument("--pollers", type=int, default=25, help="clients polling decisions")
    parser.add_argument("--batch", type=int, default=100, help="observations per POST")
    parser.add_argument("--poll-every", type=float, default=0.05, help="seconds between GETs")
    parser.add_argument(
        "--rate", type=float, default=0.0, help="observations/s in all (0: as fast as can be)"
    )
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of load (max)")
    parser.add_argument("--max-requests", type=int, default=100_000, help="requests (max)")
    parser.add_argument("--interval", default="2s", help="the sidecar's decision interval")
    args = parser.parse_args()
    out = ResultFile(__file__, __doc__, args.results, preformatted=True)
    policy = yaml.safe_load((ROOT / "policies" / "default.yaml").read_text())
    policy.update(interval=args.interval, min_dwell="0s")
    with tempfile.TemporaryDirectory() as folder:
        policy_file = Path(folder) / "policy.yaml"
        policy_file.write_text(yaml.safe_dump(policy))
        port = free_port()
        server = start_server(policy_file, port)
        try:
            rss_start = rss_kib(server.pid)
            samples: list[int] = []
            stop = threading.Event()
            sampler = threading.Thread(target=sample_rss, args=(server.pid, samples, stop))
            sampler.start()
            result = asyncio.run(drive(port, args, make_bodies(args.batch)))
            stop.set()
            sampler.join()
            peak = rss_kib(server.pid, "VmHWM")
            decisions = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        finally:
            server.terminate()
            server.wait(timeout=30)

    elapsed = result["elapsed_s"]
    offered = f"at {args.rate:g}/s in all" if args.rate > 0 else "back to back"
    out.print(
        f"sidecar load: {args.posters} posters x {args.batch} observations {offered}, "
        f"{args.pollers} pollers every {args.poll_every:g} s, {elapsed:.1f} s, "
        f"{os.cpu_count()} CPUs"
    )
    out.print(f"  observations/s          {result['observations'] / elapsed:10.0f}")
    out.print(f"  POST /v1/observations   {percentiles(result['post_ms'])}")
    out.print(f"  GET /v1/recommendation  {percentiles(result['get_ms'])}")
    out.print(f"  failed requests         {result['failures']}")
    made = [line for line in decisions.splitlines() if line.startswith("blocktune_decisions")]
    out.print(f"  decisions during load   {', '.join(made)}")
    out.print(
        f"  server RSS              start {rss_start / 1024:.1f} MiB, peak {peak / 1024:.1f} MiB"
    )
    out.print("  RSS each second (MiB)   " + " ".join(f"{s / 1024:.1f}" for s in samples))
    out.write()


if __name__ == "__main__":
    main()
