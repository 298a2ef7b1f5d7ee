"""A stand-in for `python -m vllm.entrypoints.openai.api_server` in tests without vLLM.

It takes vLLM's `--block-size`, `--host` and `--port` (and ignores the other
flags vLLM takes), logs the platform line vLLM logs, and, after a start delay
(the model load), refuses a block size its backend rule refuses the way vLLM
does (an error line naming the backend's sizes, exit code 1) or starts serving
`/health` and a vLLM-format `/metrics` (`vllm:cache_config_info{block_size}`,
running and waiting requests, the request-length histograms).

Test knobs: `--start-delay S`, `--multiple N` (the backend accepts multiples of
N; 32 as vLLM's CPU backend), `--backend NAME` (also logged as a CUDA vLLM
logs it), `--busy-for S` (one request counts as running for S seconds after
the start, to exercise the drain), `--hang-at B` (never healthy at block size B),
`--ignore-sigterm` (to exercise the SIGKILL after the stop timeout).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LENGTH_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


def metrics_text(block_size: int, running: int) -> str:
    """One scrape, in vLLM's names, with three finished requests of 10, 100 and 1000
    prompt tokens and 20 output tokens each."""
    labels = 'engine="0",model_name="fake"'
    lines = [
        "# TYPE vllm:cache_config_info gauge",
        f'vllm:cache_config_info{{block_size="{block_size}",cache_dtype="auto",engine="0"}} 1.0',
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{labels}}} {running}.0",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{labels}}} 0.0",
    ]
    for name, lengths in (
        ("vllm:request_prompt_tokens", (10, 100, 1000)),
        ("vllm:request_generation_tokens", (20, 20, 20)),
    ):
        lines.append(f"# TYPE {name} histogram")
        for bound in (*LENGTH_BUCKETS, "+Inf"):
            count = sum(1 for n in lengths if bound == "+Inf" or n <= bound)
            le = bound if bound == "+Inf" else f"{float(bound)}"
            lines.append(f'{name}_bucket{{{labels},le="{le}"}} {count}.0')
        lines.append(f"{name}_sum{{{labels}}} {float(sum(lengths))}")
        lines.append(f"{name}_count{{{labels}}} {float(len(lengths))}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--start-delay", type=float, default=0.3)
    parser.add_argument("--multiple", type=int, default=32)
    parser.add_argument("--backend", default="CPU_ATTN")
    parser.add_argument("--platform", default="cpu")
    parser.add_argument("--busy-for", type=float, default=0.0)
    parser.add_argument("--hang-at", type=int, default=None, help="never healthy at this size")
    parser.add_argument("--ignore-sigterm", action="store_true")
    args, _vllm_flags = parser.parse_known_args(argv)
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"INFO fake-vllm: Automatically detected platform {args.platform}.", flush=True)
    if args.platform != "cpu":
        print(f"INFO fake-vllm: Using {args.backend} attention backend.", flush=True)
    time.sleep(args.start_delay)
    if args.block_size % args.multiple:
        print(
            f"ValueError: No common block size for {args.block_size} "
            f"({args.backend}: [MultipleOf({args.multiple})]).",
            flush=True,
        )
        return 1
    if args.block_size == args.hang_at:
        while True:
            time.sleep(1)
    started = time.monotonic()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            if self.path == "/health":
                self._answer(200, "")
            elif self.path == "/metrics":
                busy = time.monotonic() - started < args.busy_for
                self._answer(200, metrics_text(args.block_size, int(busy)))
            else:
                self._answer(404, "not found")

        def _answer(self, status: int, body: str) -> None:
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *_args: object) -> None:
            """Quiet: requests are not logged."""

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"INFO fake-vllm: serving block size {args.block_size} on {args.port}", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
