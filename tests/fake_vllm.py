"""A stand-in for `python -m vllm.entrypoints.openai.api_server` in tests without vLLM.

It takes vLLM's `--block-size`, `--host` and `--port` (and ignores the other
flags vLLM takes), logs the platform line vLLM logs, and, after a start delay
(the model load), refuses a block size its backend rule refuses the way vLLM
does (an error line naming the backend's sizes, exit code 1) or starts serving
`/health` and a vLLM-format `/metrics` (`vllm:cache_config_info{block_size}`,
running and waiting requests, the request-length histograms).

It also serves `/v1/models` and `/v1/completions` (a prompt of token ids or text,
`max_tokens`, `stream` with vLLM's `return_token_ids`): a batching engine runs
steps like vLLM's scheduler (each step admits the waiting requests, whose whole
prompts it prefills, and decodes one token of every running one) and sleeps each
step for the simulator's step form at known coefficients (`--step`), so a
calibration fitted from the streamed tokens' arrival times can be checked against
them.

Test knobs: `--start-delay S`, `--multiple N` (the backend accepts multiples of
N; 32 as vLLM's CPU backend), `--backend NAME` (also logged as a CUDA vLLM
logs it), `--busy-for S` (one request counts as running for S seconds after
the start, to exercise the drain), `--hang-at B` (never healthy at block size B),
`--ignore-sigterm` (to exercise the SIGKILL after the stop timeout),
`--exit-after S` (exits with code 3 S seconds after it began serving, as a server that
crashes between switches), `--log-requests` (logs each completion's prompt as vLLM's
request logging does), `--step fixed_s=X,per_sequence_s=Y,...` (the step form's
coefficients, in seconds; `per_block_s` is charged per block of the running size).

It logs as vLLM does (`INFO 12-01 10:00:00 [file.py:123] message`, a traceback
before it exits on an error), and, as vLLM's logging, it outlives a closed output:
a line it cannot write is lost, not the server (so a sidecar killed with SIGKILL
leaves it serving, as it leaves a real vLLM).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LENGTH_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
STEP_TERMS = (
    "fixed_s",
    "per_sequence_s",
    "per_token_s",
    "per_block_s",
    "prefill_s_per_token",
    "per_admission_s",
)
DEFAULT_STEP = "fixed_s=0.002,per_sequence_s=0.0005,per_token_s=0.000002"


def say(text: str, *, level: str = "INFO", where: str = "fake_vllm.py:1") -> None:
    """Write one line in vLLM's log format; a closed output loses the line, as
    `logging.Handler.handleError` does for vLLM, and the server carries on."""
    stamp = time.strftime("%m-%d %H:%M:%S")
    line = text if level == "" else f"{level} {stamp} [{where}] {text}"
    try:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    except (BrokenPipeError, OSError, ValueError):
        with_nothing = os.open(os.devnull, os.O_WRONLY)
        os.dup2(with_nothing, sys.stdout.fileno())  # later lines go nowhere, quietly
        os.close(with_nothing)


def step_coefficients(text: str) -> dict[str, float]:
    """`--step`'s `name=seconds` pairs; the terms left out are 0."""
    coefficients = dict.fromkeys(STEP_TERMS, 0.0)
    for pair in filter(None, text.split(",")):
        name, _, value = pair.partition("=")
        if name not in coefficients:
            raise argparse.ArgumentTypeError(f"unknown step term {name!r}: one of {STEP_TERMS}")
        coefficients[name] = float(value)
    return coefficients


@dataclass
class Request:
    """One completion: its prompt length, the tokens to generate, and a queue the engine
    puts each step's new token ids on (None when done)."""

    prompt_tokens: int
    max_tokens: int
    tokens: queue.Queue = field(default_factory=queue.Queue)
    generated: int = 0


class Engine:
    """A batching loop: each step admits every waiting request (up to `max_seqs` running)
    and prefills its whole prompt, decodes one token of every running request, and takes the
    step form's time for the requests in it (a request holds prompt + generated tokens)."""

    def __init__(self, coefficients: dict[str, float], block_size: int, max_seqs: int = 256):
        self.coefficients = coefficients
        self.block_size = block_size
        self.max_seqs = max_seqs
        self.waiting: queue.Queue[Request] = queue.Queue()
        self.running: list[Request] = []
        threading.Thread(target=self._loop, name="fake-vllm-engine", daemon=True).start()

    def in_flight(self) -> tuple[int, int]:
        return len(self.running), self.waiting.qsize()

    def used_blocks(self) -> int:
        """Blocks the running requests hold."""
        held = (r.prompt_tokens + r.generated for r in list(self.running))
        return sum(math.ceil(n / self.block_size) for n in held)

    def step_s(self, admitted: list[Request], decoding: list[Request]) -> float:
        c = self.coefficients
        held = [r.prompt_tokens + r.generated for r in admitted + decoding]
        return (
            c["fixed_s"]
            + c["per_sequence_s"] * len(held)
            + c["per_token_s"] * sum(held)
            + c["per_block_s"] * sum(math.ceil(n / self.block_size) for n in held)
            + c["prefill_s_per_token"] * sum(r.prompt_tokens for r in admitted)
            + c["per_admission_s"] * len(admitted)
        )

    def _loop(self) -> None:
        while True:
            admitted = []
            if not self.running:
                admitted.append(self.waiting.get())
            while len(self.running) + len(admitted) < self.max_seqs:
                try:
                    admitted.append(self.waiting.get_nowait())
                except queue.Empty:
                    break
            decoding = list(self.running)
            time.sleep(self.step_s(admitted, decoding))
            self.running = []
            for request in decoding + admitted:
                request.generated += 1
                request.tokens.put([request.generated])
                if request.generated < request.max_tokens:
                    self.running.append(request)
                else:
                    request.tokens.put(None)


def metrics_text(
    block_size: int, running: int, waiting: int = 0, used_blocks: int = 0, num_blocks: int = 4096
) -> str:
    """One scrape, in vLLM's names, with three finished requests of 10, 100 and 1000
    prompt tokens and 20 output tokens each."""
    labels = 'engine="0",model_name="fake"'
    info = f'block_size="{block_size}",cache_dtype="auto",engine="0",num_gpu_blocks="{num_blocks}"'
    lines = [
        "# TYPE vllm:cache_config_info gauge",
        f"vllm:cache_config_info{{{info}}} 1.0",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{{{labels}}} {used_blocks / num_blocks}",
        "# TYPE vllm:num_preemptions counter",
        f"vllm:num_preemptions_total{{{labels}}} 0.0",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{labels}}} {running}.0",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{labels}}} {waiting}.0",
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
    parser.add_argument("--exit-after", type=float, default=None, help="crash after S serving")
    parser.add_argument("--log-requests", action="store_true")
    parser.add_argument("--step", type=step_coefficients, default=step_coefficients(DEFAULT_STEP))
    args, _vllm_flags = parser.parse_known_args(argv)
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    say(f"Automatically detected platform {args.platform}.", where="__init__.py:239")
    if args.platform != "cpu":
        say(f"Using {args.backend} attention backend.", where="cuda.py:344")
    time.sleep(args.start_delay)
    if args.block_size % args.multiple:
        say("Traceback (most recent call last):", level="")
        say('  File "vllm/v1/worker/utils.py", line 80, in select_common_block_size', level="")
        say(
            f"ValueError: No common block size for {args.block_size} "
            f"({args.backend}: [MultipleOf({args.multiple})]).",
            level="",
        )
        return 1
    if args.block_size == args.hang_at:
        while True:
            time.sleep(1)
    started = time.monotonic()
    engine = Engine(args.step, args.block_size)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            if self.path == "/health":
                self._answer(200, "")
            elif self.path == "/metrics":
                busy = time.monotonic() - started < args.busy_for
                running, waiting = engine.in_flight()
                text = metrics_text(
                    args.block_size, running + int(busy), waiting, engine.used_blocks()
                )
                self._answer(200, text)
            elif self.path == "/version":
                self._answer(200, json.dumps({"version": "0.0.0+fake"}))
            elif self.path == "/v1/models":
                self._answer(200, json.dumps({"object": "list", "data": [{"id": "fake"}]}))
            else:
                self._answer(404, "not found")

        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            if self.path != "/v1/completions":
                self._answer(404, "not found")
                return
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            prompt = body["prompt"]
            if args.log_requests:
                say(f"Received request cmpl-1: prompt: {prompt!r}", where="logger.py:43")
            length = len(prompt) if isinstance(prompt, list) else len(prompt.split())
            request = Request(length, int(body.get("max_tokens", 16)))
            engine.waiting.put(request)
            if not body.get("stream"):
                while request.tokens.get() is not None:
                    pass
                usage = {"prompt_tokens": length, "completion_tokens": request.generated}
                choice = {"index": 0, "text": " t" * request.generated, "finish_reason": "length"}
                self._answer(200, json.dumps({"choices": [choice], "usage": usage}))
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            while (ids := request.tokens.get()) is not None:
                choice = {"index": 0, "text": " t", "finish_reason": None}
                if body.get("return_token_ids"):
                    choice["token_ids"] = ids
                self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")

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
    say(f"serving block size {args.block_size} on {args.port}", where="api_server.py:1")
    if args.exit_after is not None:
        threading.Timer(args.exit_after, os._exit, (3,)).start()
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
