"""Streaming load on the worker with live block-size swaps.

Starts `blocktune worker` in a subprocess (`--model`: tiny-random, the tests'
model, or smollm2 for the real one) with an admin bearer token and waits for
/health. Then `--streams` clients stream /v1/completions and
/v1/chat/completions in turn, each starting its next request when its last one
ended, with mixed max_tokens and sampling fields (stop strings, logit_bias,
penalties, seeds, top_k/top_p, min_tokens with stop_token_ids, n = 2), for
`--duration` seconds, while a swapper POSTs /admin/block-size with a random
other candidate every `--swap-every` seconds. Once the last answers are in and
the engine is idle it reads /admin/state, and prints the answers completed,
the refusals by HTTP status (the 5xx on their own line), error events inside
streams, connections lost, the swaps done, rejected and rolled back, the KV
blocks still in use, the engine's failed steps, output tokens per second, and
the worker's resident memory: at start, every `--rss-every` seconds and after
the load, and the highest of these.

    python bench/worker_load.py [--streams 120] [--duration 150] [--swap-every 8]
                                [--model tiny-random] [--candidates 8 16 32 64 128]

Exits 1 when an answer or a swap was a 5xx, a stream ended with an error event
or lost its connection, KV blocks were left in use or the worker exited: a check
to run by hand, never in CI. Linux only for the memory figures (/proc/PID/status).
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
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from result_file import ResultFile, bench_parser

from blocktune.runtime.defaults import DEFAULT_CANDIDATES
from blocktune.tuner.config.defaults import DEFAULT_TOKEN_ENV
from blocktune.tuner.operations import NotReady, free_port, wait_until_ready

TOKEN = "bench-token"
START_TIMEOUT_S = 300.0
READ_TIMEOUT_S = 300.0  # the longest wait for a stream's next event, or a swap's answer
IDLE_TIMEOUT_S = 60.0  # after the load, how long the engine may take to empty its queues
IDLE_POLL_S = 0.2
STOP_TIMEOUT_S = 30.0
LOG_TAIL_LINES = 20

PROMPTS = (
    "Where is my parcel?",
    "Write a haiku about block sizes.",
    "Translate to French: the train leaves at nine.",
    "Summarise this note in one line: " + "the meeting moved to Thursday at ten. " * 12,
    "List three uses of a paged KV cache, then explain the first in detail. " * 5,
)
MAX_TOKENS = (8, 16, 32, 64, 128)
SAMPLING = (  # token ids under 256: inside the vocabulary of every model served
    {},
    {"temperature": 0.0},
    {"temperature": 0.7, "stop": ["\n\n", "."]},
    {"logit_bias": {"13": -100, "42": 5, "200": 2.5}},
    {"top_k": 20, "top_p": 0.9, "seed": 7},
    {"presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.1},
    {"min_tokens": 4, "stop_token_ids": [2, 3]},
    {"n": 2, "temperature": 0.8, "seed": 11},
)


@dataclass
class Tally:
    """What the clients and the swapper saw."""

    completed: Counter = field(default_factory=Counter)  # answers by route
    output_tokens: int = 0
    statuses: Counter = field(default_factory=Counter)  # refusals by HTTP status
    stream_errors: Counter = field(default_factory=Counter)  # by the error event's type
    lost: Counter = field(default_factory=Counter)  # by the httpx exception
    swaps: Counter = field(default_factory=Counter)  # by result status, or HTTP status


def request(rng: random.Random, turn: int, model: str) -> tuple[str, dict]:
    """The route and body of a client's `turn`-th request: completions and chat in turn."""
    prompt, max_tokens = rng.choice(PROMPTS), rng.choice(MAX_TOKENS)
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    body.update(rng.choice(SAMPLING))
    if turn % 2:
        messages = [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", {
            **body,
            "messages": messages,
            "max_completion_tokens": max_tokens,
        }
    return "/v1/completions", {**body, "prompt": prompt, "max_tokens": max_tokens}


async def stream_one(http: httpx.AsyncClient, path: str, body: dict, tally: Tally) -> None:
    """Send one streaming request and count how it ended."""
    done, usage, error = False, None, None
    try:
        async with http.stream("POST", path, json=body) as answer:
            if answer.status_code != 200:
                await answer.aread()
                tally.statuses[answer.status_code] += 1
                return
            async for line in answer.aiter_lines():
                data = line.removeprefix("data: ")
                if data == line or not data:
                    continue
                if data == "[DONE]":
                    done = True
                    continue
                chunk = json.loads(data)
                error = chunk.get("error", error)
                usage = chunk.get("usage") or usage
    except httpx.HTTPError as failure:
        tally.lost[type(failure).__name__] += 1
        return
    if error is not None:
        tally.stream_errors[error.get("type", "unknown")] += 1
    elif not done:
        tally.lost["no [DONE]"] += 1
    else:
        tally.completed[path] += 1
        tally.output_tokens += usage["completion_tokens"] if usage else 0


async def client(
    http: httpx.AsyncClient, index: int, args: argparse.Namespace, deadline: float, tally: Tally
) -> None:
    """Stream one request after another until the deadline."""
    rng = random.Random(f"{args.seed}-{index}")
    turn = index
    while time.perf_counter() < deadline:
        await stream_one(http, *request(rng, turn, args.model), tally)
        turn += 1


async def swapper(
    http: httpx.AsyncClient, args: argparse.Namespace, deadline: float, tally: Tally
) -> None:
    """Every `--swap-every` seconds until the deadline, swap to a random other candidate."""
    rng = random.Random(args.seed)
    size = (await http.get("/admin/state")).json()["block_size"]
    auth = {"Authorization": f"Bearer {TOKEN}"}
    next_at = time.perf_counter() + args.swap_every
    while next_at < deadline:
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        next_at += args.swap_every
        target = rng.choice([c for c in args.candidates if c != size])
        try:
            answer = await http.post("/admin/block-size", json={"block_size": target}, headers=auth)
        except httpx.HTTPError as failure:
            tally.swaps[f"lost ({type(failure).__name__})"] += 1
            continue
        if answer.status_code != 200:
            tally.swaps[answer.status_code] += 1
            continue
        result = answer.json()
        tally.swaps[result["status"]] += 1
        size = result["new_block_size"] if result["status"] == "done" else size


def rss_kib(pid: int, name: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1])
    raise KeyError(name)


async def sample_rss(pid: int, every_s: float, samples: list[int]) -> None:
    """Append the worker's RSS every `every_s` seconds until cancelled."""
    while True:
        await asyncio.sleep(every_s)
        samples.append(rss_kib(pid))


async def idle_state(http: httpx.AsyncClient) -> tuple[dict, float]:
    """The engine's state once nothing runs or waits (or after IDLE_TIMEOUT_S), and the
    seconds that took."""
    start = time.perf_counter()
    while True:
        state = (await http.get("/admin/state")).json()
        waited = time.perf_counter() - start
        if state["running"] == state["waiting"] == 0 or waited > IDLE_TIMEOUT_S:
            return state, waited
        await asyncio.sleep(IDLE_POLL_S)


async def drive(url: str, pid: int, args: argparse.Namespace) -> dict:
    """Run the clients and the swapper, let the engine go idle and read its state."""
    tally, samples = Tally(), [rss_kib(pid)]
    limits = httpx.Limits(max_connections=args.streams + 2, max_keepalive_connections=0)
    timeout = httpx.Timeout(READ_TIMEOUT_S, connect=10.0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as http:
        sampler = asyncio.create_task(sample_rss(pid, args.rss_every, samples))
        start = time.perf_counter()
        deadline = start + args.duration
        await asyncio.gather(
            swapper(http, args, deadline, tally),
            *(client(http, i, args, deadline, tally) for i in range(args.streams)),
        )
        elapsed = time.perf_counter() - start
        state, idle_after = await idle_state(http)
        sampler.cancel()
    rss_end = rss_kib(pid)
    return {
        "tally": tally,
        "elapsed_s": elapsed,
        "state": state,
        "idle_after_s": idle_after,
        "samples": samples,
        "rss_end": rss_end,
        "peak": max(*samples, rss_end),
    }


def start_worker(args: argparse.Namespace, port: int, log_path: Path) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "blocktune.tuner.cli", "worker", "--model", args.model,
        "--port", str(port), "--kv-bytes", args.kv_bytes,
        "--candidates", *map(str, args.candidates),
    ]  # fmt: skip
    env = {**os.environ, DEFAULT_TOKEN_ENV: TOKEN}
    with log_path.open("w") as log:
        worker = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until_ready(
            f"http://127.0.0.1:{port}", worker, timeout_s=START_TIMEOUT_S, path="/health"
        )
    except NotReady as error:
        stop_worker(worker)
        raise SystemExit(f"{error}; the worker's log ends:\n{log_tail(log_path)}") from None
    return worker


def stop_worker(worker: subprocess.Popen) -> None:
    worker.terminate()
    try:
        worker.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait()


def log_tail(path: Path) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])


def counts(counter: Counter) -> str:
    return ", ".join(f"{key}: {n}" for key, n in sorted(counter.items(), key=str)) or "none"


def failures(result: dict, exit_code: int | None) -> list[str]:
    """Why the run fails the check (empty when it passes)."""
    tally, state = result["tally"], result["state"]
    found = {
        "5xx answers": sum(n for status, n in tally.statuses.items() if status >= 500),
        "5xx swaps": sum(n for s, n in tally.swaps.items() if isinstance(s, int) and s >= 500),
        "stream error events": sum(tally.stream_errors.values()),
        "connections lost": sum(tally.lost.values()),
        "KV blocks left in use": state["blocks_used"],
    }
    reasons = [f"{n} {what}" for what, n in found.items() if n]
    return reasons + ([f"the worker exited with {exit_code}"] if exit_code is not None else [])


def report(out: ResultFile, args: argparse.Namespace, result: dict, reasons: list[str]) -> None:
    tally, state, elapsed = result["tally"], result["state"], result["elapsed_s"]
    answers = tally.completed.total()
    mib = [f"{kib / 1024:.1f}" for kib in result["samples"]]
    rows = {
        "answers completed": f"{answers} ({answers / elapsed:.1f}/s; {counts(tally.completed)})",
        "5xx answers": sum(n for status, n in tally.statuses.items() if status >= 500),
        "refusals by status": counts(tally.statuses),
        "stream error events": counts(tally.stream_errors),
        "connections lost": counts(tally.lost),
        "swaps": counts(tally.swaps),
        "KV blocks in use after": f"{state['blocks_used']} of {state['blocks_total']} (engine "
        f"idle {result['idle_after_s']:.1f} s after the load: {state['running']} running, "
        f"{state['waiting']} waiting)",
        "engine failed steps": state["failed_steps"],
        "output tokens/s": f"{tally.output_tokens / elapsed:.0f}",
        "worker RSS (MiB)": f"start {mib[0]}, peak {result['peak'] / 1024:.1f}, "
        f"end {result['rss_end'] / 1024:.1f}",
        f"RSS every {args.rss_every:g} s (MiB)": " ".join(mib),
        "check": "FAILED: " + "; ".join(reasons) if reasons else "passed",
    }
    out.print(
        f"worker load: {args.streams} streams for {args.duration:g} s ({elapsed:.1f} s with the "
        f"last answers), a swap every {args.swap_every:g} s among {args.candidates}, "
        f"model {args.model}, {os.cpu_count()} CPUs"
    )
    for label, value in rows.items():
        out.print(f"  {label:<24}{value}")


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--streams", type=int, default=120, help="concurrent streaming clients")
    parser.add_argument("--duration", type=float, default=150.0, help="seconds of load")
    parser.add_argument("--swap-every", type=float, default=8.0, help="seconds between swaps")
    parser.add_argument("--model", default="tiny-random", help="the worker's --model")
    parser.add_argument(
        "--candidates",
        type=int,
        nargs="+",
        default=list(DEFAULT_CANDIDATES),
        help="the worker's candidate block sizes, which the swaps choose among",
    )
    parser.add_argument("--kv-bytes", default="64MiB", help="the worker's KV pool")
    parser.add_argument("--rss-every", type=float, default=5.0, help="seconds between RSS reads")
    parser.add_argument("--seed", type=int, default=0, help="seed of the requests and swaps")
    args = parser.parse_args()
    out = ResultFile(__file__, __doc__, args.results, preformatted=True)
    with tempfile.TemporaryDirectory() as folder:
        port, log_path = free_port(), Path(folder) / "worker.log"
        worker = start_worker(args, port, log_path)
        try:
            result = asyncio.run(drive(f"http://127.0.0.1:{port}", worker.pid, args))
        except httpx.HTTPError as error:
            raise SystemExit(
                f"the worker stopped answering ({error!r}); its log ends:\n{log_tail(log_path)}"
            ) from None
        finally:
            exit_code = worker.poll()
            stop_worker(worker)
    reasons = failures(result, exit_code)
    report(out, args, result, reasons)
    out.write()
    return 1 if reasons else 0


if __name__ == "__main__":
    sys.exit(main())
