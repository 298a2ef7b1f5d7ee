"""guidellm and aiperf, each from its own virtual environment, against the worker serving SmolLM2.

`make bench-clients` installs the two tools into their own venvs (never the project's) and
runs this script with the project's interpreter. It

1. writes SmolLM2's tokenizer as a Hugging Face folder, which both tools count tokens with
   (with no network, they cannot fetch it by the model's name);
2. starts `blocktune worker --model smollm2` on a free loopback port and waits for `/health`;
3. runs a short benchmark of each tool with its default request shape (guidellm: streamed
   chat completions with `ignore_eos` and `continuous_usage_stats`; aiperf: streamed chat
   completions), no rewrite rules and no extra request bodies;
4. writes the tools' TTFT, inter-token latency and throughput and the commands to a new dated
   result file under `--results` (`bench/result_file.py`: the command and the machine's load).

With `--capture DIR` the tools talk to the worker through a recording proxy, which writes
each tool's requests (method, path and JSON body of the first request per method and
path) to `DIR/<tool>.json`: the bodies the tests replay (tests/data/clients/).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from result_file import ResultFile, bench_parser, shorten

MODEL = "smollm2"
START_TIMEOUT_S = 300  # loading SmolLM2 and compiling kernels on a small CPU machine
RUN_TIMEOUT_S = 1800


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_worker(port: int, log_path: Path) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "blocktune.tuner.cli", "worker", "--model", MODEL,
        "--port", str(port), "--kv-bytes", "64MiB",
    ]  # fmt: skip
    log = log_path.open("w")
    worker = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if worker.poll() is not None:
            raise SystemExit(f"the worker exited with {worker.returncode}; see {log_path}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return worker
        time.sleep(1)
    worker.terminate()
    raise SystemExit(f"the worker did not answer /health within {START_TIMEOUT_S} s")


class CaptureProxy:
    """A loopback reverse proxy in front of the worker that records each tool's requests."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.port = free_port()
        self.tool = "unknown"
        self.captured: dict[str, list[dict]] = {}
        self._server = None

    def app(self):
        from starlette.applications import Starlette
        from starlette.responses import StreamingResponse
        from starlette.routing import Route

        client = httpx.AsyncClient(base_url=self.upstream, timeout=None)

        async def forward(request):
            body = await request.body()
            self._record(request.method, request.url.path, body)
            headers = {k: v for k, v in request.headers.items() if k.lower() != "host"}
            upstream = client.build_request(
                request.method, request.url.path, content=body, headers=headers,
                params=request.query_params,
            )  # fmt: skip
            response = await client.send(upstream, stream=True)
            kept = {
                k: v
                for k, v in response.headers.items()
                if k.lower() not in ("content-length", "transfer-encoding", "connection")
            }
            return StreamingResponse(
                response.aiter_raw(), response.status_code, kept, background=None
            )

        methods = ["GET", "POST"]
        return Starlette(routes=[Route("/{path:path}", forward, methods=methods)])

    def _record(self, method: str, path: str, body: bytes) -> None:
        requests = self.captured.setdefault(self.tool, [])
        if any(r["method"] == method and r["path"] == path for r in requests):
            return
        parsed = json.loads(body) if body else None
        requests.append({"method": method, "path": path, "body": parsed})

    def start(self) -> str:
        import uvicorn

        config = uvicorn.Config(self.app(), host="127.0.0.1", port=self.port, log_level="error")
        self._server = uvicorn.Server(config)
        threading.Thread(target=self._server.run, daemon=True).start()
        while not self._server.started:
            time.sleep(0.05)
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._server.should_exit = True

    def write(self, folder: Path) -> list[Path]:
        folder.mkdir(parents=True, exist_ok=True)
        written = []
        for tool, requests in self.captured.items():
            path = folder / f"{tool}.json"
            path.write_text(json.dumps(requests, indent=2) + "\n")
            written.append(path)
        return written


def run_tool(name: str, command: list[str], log_path: Path) -> float:
    print(f"$ {' '.join(command)}", flush=True)
    started = time.monotonic()
    with log_path.open("w") as log:
        done = subprocess.run(
            command, stdout=log, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S, check=False
        )
    if done.returncode != 0:
        tail = log_path.read_text()[-3000:]
        raise SystemExit(f"{name} exited with {done.returncode}:\n{tail}")
    return time.monotonic() - started


def guidellm(binary: str, target: str, tokenizer: Path, args, out: Path) -> tuple[list, dict]:
    report = out / "guidellm.json"
    command = [
        binary, "run",
        "--backend", f"kind=openai_http,target={target}",
        "--tokenizer", f"kind=hf_auto,model={tokenizer}",
        "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},"
        f"output_tokens={args.output_tokens}",
        "--profile", "kind=synchronous",
        "--constraint", f"kind=max_requests,count={args.requests}",
        "--output", f"kind=json,path={report}",
        "--disable-console-interactive",
    ]  # fmt: skip
    run_tool("guidellm", command, out / "guidellm.log")
    data = json.loads(report.read_text())
    metrics = data["benchmarks"][0]["metrics"]

    def median(key: str, scale: float = 1.0) -> float:
        return metrics[key]["successful"]["median"] * scale

    figures = {
        "requests": metrics["request_totals"]["successful"],
        "errors": metrics["request_totals"]["errored"],
        "TTFT median (ms)": median("time_to_first_token_ms"),
        "ITL median (ms)": median("inter_token_latency_ms"),
        "output tokens/s": metrics["output_tokens_per_second"]["successful"]["mean"],
        "requests/s": metrics["requests_per_second"]["successful"]["mean"],
    }
    return command, figures


def aiperf(binary: str, target: str, tokenizer: Path, args, out: Path) -> tuple[list, dict]:
    artifacts = out / "aiperf"
    command = [
        binary, "profile",
        "--model", MODEL,
        "--url", target,
        "--endpoint-type", "chat",
        "--streaming",
        "--tokenizer", str(tokenizer),
        "--isl", str(args.prompt_tokens),
        "--osl", str(args.output_tokens),
        "--request-count", str(args.requests),
        "--concurrency", "1",
        "--artifact-dir", str(artifacts),
        "--ui", "none",
    ]  # fmt: skip
    run_tool("aiperf", command, out / "aiperf.log")
    (report,) = artifacts.rglob("profile_export_aiperf.json")
    data = json.loads(report.read_text())

    def value(key: str, stat: str = "avg") -> float:
        return data[key][stat]

    figures = {
        "requests": value("request_count"),
        "errors": data.get("error_request_count", {}).get("avg", 0),
        "TTFT median (ms)": value("time_to_first_token", "p50"),
        "ITL median (ms)": value("inter_token_latency", "p50"),
        "output tokens/s": value("output_token_throughput"),
        "requests/s": value("request_throughput"),
    }
    return command, figures


def report(out: ResultFile, results: dict, args) -> None:
    """The tools' figures as a table, and their commands."""
    columns = ["requests", "errors", "TTFT median (ms)", "ITL median (ms)"]
    columns += ["output tokens/s", "requests/s"]
    lines = [
        "guidellm and aiperf, each from its own venv, benchmark the worker serving",
        f"SmolLM2-135M-Instruct (`blocktune worker --model {MODEL}`, CPU, fp32) with their default",
        "request shapes, no rewrite rules and no extra request bodies: "
        f"{args.requests} requests one at a time, {args.prompt_tokens} prompt tokens and "
        f"{args.output_tokens} output tokens each.",
        "The figures are each tool's own report of one run; they measure this machine, not a",
        "GPU deployment.",
        "",
        "| tool | " + " | ".join(columns) + " |",
        "| --- |" + " ---: |" * len(columns),
    ]
    for tool, (_, figures) in results.items():
        cells = [_cell(figures[c]) for c in columns]
        lines.append(f"| {tool} | " + " | ".join(cells) + " |")
    lines += ["", "Commands (paths shortened):", ""]
    for tool, (command, _) in results.items():
        lines += [f"- {tool}: `{shorten(' '.join(command))}`"]
    for line in lines:
        out.print(line)


def _cell(value) -> str:
    return f"{value:.1f}" if isinstance(value, float) and not value.is_integer() else f"{value:g}"


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--guidellm", required=True, help="the guidellm executable")
    parser.add_argument("--aiperf", required=True, help="the aiperf executable")
    parser.add_argument("--requests", type=int, default=8, help="requests per tool")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="prompt tokens a request")
    parser.add_argument("--output-tokens", type=int, default=32, help="output tokens a request")
    parser.add_argument("--capture", type=Path, help="write each tool's requests here")
    parser.add_argument(
        "--keep", type=Path, help="keep the tools' logs and reports here (else discarded)"
    )
    args = parser.parse_args(argv)
    out = ResultFile(__file__, __doc__, args.results, argv=argv)

    from blocktune.runtime.loading import load_pretrained

    with tempfile.TemporaryDirectory(prefix="bench-clients-") as scratch:
        work = Path(scratch) if args.keep is None else args.keep
        work.mkdir(parents=True, exist_ok=True)
        tokenizer = work / "tokenizer"
        load_pretrained(MODEL).tokenizer.save_pretrained(tokenizer)
        port = free_port()
        worker = start_worker(port, work / "worker.log")
        proxy = CaptureProxy(f"http://127.0.0.1:{port}") if args.capture else None
        target = proxy.start() if proxy else f"http://127.0.0.1:{port}"
        results = {}
        try:
            for name, run in (("guidellm", guidellm), ("aiperf", aiperf)):
                if proxy:
                    proxy.tool = name
                binary = shutil.which(getattr(args, name)) or getattr(args, name)
                results[name] = run(binary, target, tokenizer, args, work)
                print(f"{name}: {results[name][1]}", flush=True)
        finally:
            if proxy:
                proxy.stop()
            worker.terminate()
            worker.wait(timeout=30)
        if proxy:
            for path in proxy.write(args.capture):
                print(f"captured {path}")
        report(out, results, args)
    out.write()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
