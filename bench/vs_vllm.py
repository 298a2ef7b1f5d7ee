"""blocktune's worker against vLLM: the same model, the same requests, the same machine.

Each engine is a server command (run here, once per dtype and run, `{port}` and
`{dtype}` filled in) or the URL of a server already running (its dtype is whatever it
serves). Against each, one run sends the same fixed workload through the `openai`
client: a warm-up request, then at each concurrency `--requests` streamed chat
completions (short questions, temperature 0, `--max-tokens`), at most that many in
flight. The engines take turns run by run (the order alternating), `--pairs` times per
dtype, so load from elsewhere on the machine falls on both alike. Per run and
concurrency it prints output tokens/s, TTFT p50/p99, TPOT p50/p99, the server's
CPU-seconds (all its processes; only for a server it started), output tokens per
CPU-second, and how many greedy outputs equal the other engine's in the same pair,
with the load average, and writes the tables to a new dated result file under `--results`.

A server keeps its prefix cache between the concurrencies of a run, and the runs at 8
and 32 send the questions the earlier ones sent, so their prompts' first blocks are
cached where prefix caching is on. vLLM and the worker both have it on by default
(`--no-enable-prefix-caching` turns it off): give both engines the same setting.

    python bench/vs_vllm.py \\
      --vllm ".venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model MODEL_DIR \\
              --dtype {dtype} --block-size 32 --enforce-eager --port {port}" \\
      --worker ".venv/bin/blocktune worker --model smollm2 --dtype {dtype} --block-size 32 \\
                --kv-bytes 1GiB --enable-prefix-caching --port {port}"
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import openai
import psutil
from result_file import ResultFile, bench_parser

from blocktune.tuner.operations import free_port, wait_until_ready

CONCURRENCY = (1, 8, 32)
DTYPES = ("float32", "bfloat16")
START_TIMEOUT_S = 600.0  # vLLM's CPU build took 38-155 s to answer here
STOP_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 600.0
TOPICS = (
    "the water cycle",
    "photosynthesis",
    "the moon's phases",
    "how a bicycle works",
    "volcanoes",
    "the history of paper",
    "why the sky is blue",
    "honey bees",
    "the printing press",
    "ocean tides",
    "how vaccines work",
    "the Roman Empire",
    "black holes",
    "rainbows",
    "the human heart",
    "electric cars",
    "the Great Wall of China",
    "coral reefs",
    "how airplanes fly",
    "the invention of the telephone",
    "earthquakes",
    "the solar system",
    "recycling",
    "the Amazon rainforest",
    "how computers store data",
    "penguins",
    "the Olympic Games",
    "glaciers",
    "the life of a star",
    "chess",
    "the first moon landing",
    "wind turbines",
)


def questions(count: int) -> list[str]:
    """`count` short questions (they repeat past the topics' number)."""
    return [f"In two sentences, explain {TOPICS[i % len(TOPICS)]}." for i in range(count)]


@dataclass
class Timing:
    """One streamed completion: when it started, its first and last token, its text."""

    start: float
    first: float | None = None
    end: float = 0.0
    tokens: int = 0
    text: str = ""


@dataclass
class Run:
    """One engine's figures at one concurrency in one run."""

    engine: str
    dtype: str
    concurrency: int
    wall_s: float
    timings: list[Timing]
    cpu_s: float | None
    load: tuple[float, float]

    @property
    def output_tokens(self) -> int:
        return sum(t.tokens for t in self.timings)

    def figures(self) -> dict[str, float | None]:
        ttft = [t.first - t.start for t in self.timings if t.first is not None]
        tpot = [(t.end - t.first) / (t.tokens - 1) for t in self.timings if t.tokens > 1]
        return {
            "tok/s": self.output_tokens / self.wall_s,
            "ttft_p50": percentile(ttft, 50),
            "ttft_p99": percentile(ttft, 99),
            "tpot_p50": percentile(tpot, 50),
            "tpot_p99": percentile(tpot, 99),
            "cpu_s": self.cpu_s,
            "tok/cpu_s": None if not self.cpu_s else self.output_tokens / self.cpu_s,
        }


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


class Server:
    """A server to send the workload to: started from a command template, or a URL."""

    def __init__(self, name: str, command: str | None, url: str | None, dtype: str) -> None:
        self.name, self.dtype = name, dtype
        self.process: subprocess.Popen | None = None
        if command is not None:
            port = free_port()
            args = shlex.split(command.format(port=port, dtype=dtype))
            self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=sys.stderr)
            self.url = f"http://127.0.0.1:{port}"
        else:
            self.url = url.rstrip("/")

    def wait_ready(self) -> str:
        """Wait for `/v1/models` to answer (a server this script started); returns the served
        model's name."""
        if self.process is not None:
            wait_until_ready(self.url, self.process, timeout_s=START_TIMEOUT_S, path="/v1/models")
        return httpx.get(f"{self.url}/v1/models", timeout=5.0).json()["data"][0]["id"]

    def cpu_seconds(self) -> float | None:
        """User and system CPU-seconds of the server's processes so far (None for a URL)."""
        if self.process is None:
            return None
        root = psutil.Process(self.process.pid)
        total = 0.0
        for proc in [root, *root.children(recursive=True)]:
            try:
                times = proc.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += times.user + times.system
        return total

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


async def complete(client: openai.AsyncOpenAI, model: str, question: str, max_tokens: int):
    timing = Timing(time.perf_counter())
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces = []
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if timing.first is None:
                timing.first = time.perf_counter()
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            timing.tokens = chunk.usage.completion_tokens
    timing.end = time.perf_counter()
    timing.text = "".join(pieces)
    return timing


async def workload(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int):
    """Send `prompts` with at most `concurrency` in flight; (wall seconds, timings)."""
    gate = asyncio.Semaphore(concurrency)
    async with openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0
    ) as client:

        async def one(question: str) -> Timing:
            async with gate:
                return await complete(client, model, question, max_tokens)

        start = time.perf_counter()
        timings = await asyncio.gather(*(one(q) for q in prompts))
        return time.perf_counter() - start, list(timings)


def run_engine(
    name: str, command: str | None, url: str | None, dtype: str, args: argparse.Namespace
) -> list[Run]:
    """Start (or reach) one server, warm it up and time the workload at each concurrency."""
    server = Server(name, command, url, dtype)
    try:
        model = server.wait_ready()
        prompts = questions(args.requests)
        asyncio.run(workload(server.url, model, prompts[:1], 1, args.max_tokens))  # warm-up
        runs = []
        for concurrency in args.concurrency:
            cpu_before = server.cpu_seconds()
            load_before = os.getloadavg()[0]
            wall, timings = asyncio.run(
                workload(server.url, model, prompts, concurrency, args.max_tokens)
            )
            cpu_after = server.cpu_seconds()
            cpu = None if cpu_before is None else cpu_after - cpu_before
            load = (load_before, os.getloadavg()[0])
            runs.append(Run(name, dtype, concurrency, wall, timings, cpu, load))
            print(row(runs[-1], None), flush=True)
        return runs
    finally:
        server.stop()


def fmt(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


HEADER = (
    "| engine | dtype | conc. | output tok/s | TTFT p50 s | TTFT p99 s | TPOT p50 s | TPOT p99 s "
    "| CPU-s | tok/CPU-s | identical | load 1 min |\n| --- | --- | --- | --- | --- | --- | --- "
    "| --- | --- | --- | --- | --- |"
)


def row(run: Run, identical: int | None) -> str:
    f = run.figures()
    same = "" if identical is None else f"{identical}/{len(run.timings)}"
    return (
        f"| {run.engine} | {run.dtype} | {run.concurrency} | {fmt(f['tok/s'], 1)} "
        f"| {fmt(f['ttft_p50'])} | {fmt(f['ttft_p99'])} | {fmt(f['tpot_p50'])} "
        f"| {fmt(f['tpot_p99'])} | {fmt(f['cpu_s'], 1)} | {fmt(f['tok/cpu_s'], 1)} | {same} "
        f"| {run.load[0]:.1f}-{run.load[1]:.1f} |"
    )


def ratio_row(worker: Run, vllm: Run) -> str:
    w, v = worker.figures(), vllm.figures()

    def over(key: str) -> str:
        return "n/a" if not w[key] or not v[key] else f"{w[key] / v[key]:.2f}"

    return (
        f"| worker / vLLM | {worker.dtype} | {worker.concurrency} | {over('tok/s')} "
        f"| {over('ttft_p50')} | {over('ttft_p99')} | {over('tpot_p50')} | {over('tpot_p99')} "
        f"| {over('cpu_s')} | {over('tok/cpu_s')} | | |"
    )


def identical(a: Run, b: Run) -> int:
    return sum(x.text == y.text for x, y in zip(a.timings, b.timings, strict=True))


def main() -> int:
    parser = bench_parser(__doc__)
    for name in ("vllm", "worker"):
        group = parser.add_mutually_exclusive_group(required=True)
        group.add_argument(f"--{name}", help=f"the {name} server's command ({{port}}, {{dtype}})")
        group.add_argument(f"--{name}-url", help=f"the URL of a running {name} server")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES), help="dtypes")
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=list(CONCURRENCY), help="most in flight"
    )
    parser.add_argument("--pairs", type=int, default=2, help="runs per engine and dtype")
    parser.add_argument("--requests", type=int, default=32, help="requests per concurrency")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens a request")
    args = parser.parse_args()
    if (args.vllm_url or args.worker_url) and len(args.dtypes) > 1:
        parser.error("a server given by URL serves one dtype: give --dtypes with one value")
    out = ResultFile(__file__, __doc__, args.results)
    engines = [("vLLM", args.vllm, args.vllm_url), ("worker", args.worker, args.worker_url)]
    print(HEADER)
    lines = []
    for dtype in args.dtypes:
        for pair in range(args.pairs):
            order = engines if pair % 2 == 0 else engines[::-1]
            results = {name: run_engine(name, cmd, url, dtype, args) for name, cmd, url in order}
            for vllm, worker in zip(results["vLLM"], results["worker"], strict=True):
                same = identical(vllm, worker)
                lines += [row(vllm, same), row(worker, same), ratio_row(worker, vllm)]
            print("\n".join(lines[-3 * len(args.concurrency) :]), flush=True)
    out.print(HEADER)
    for line in lines:
        out.print(line)
    out.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
