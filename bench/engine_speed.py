"""Engine speed on a fixed workload: prefill and decode step times, output tokens per second.

The workload is the one `bench/vs_vllm.py` sends over HTTP, served here on the engine
directly (no HTTP): `--requests` of its short chat questions through the model's chat
template, all queued at once, at most `--concurrency` running together, `--max-tokens`
greedy tokens each. It prints the median prefill and decode step, the output tokens
per CPU-second and per second of the whole run, and a digest of every generated
token, so two builds can be compared for speed and for identical output (run it once
per build, back to back: each run's result file holds the machine's load). With several
`--dtype`s, each after the first also counts the requests whose tokens equal the first dtype's.

Steps are timed by the serving thread's CPU time, which leaves out the waits for a
core that other processes hold (with `--threads 1` it is the step's whole cost).

    python bench/engine_speed.py [--model smollm2] [--dtype float32 bfloat16] [--threads 1]

`--model tiny-random` runs it in seconds (its byte tokenizer reads the questions' UTF-8).
"""

from __future__ import annotations

import hashlib
import statistics
import time

import torch
from result_file import ResultFile, bench_parser
from vs_vllm import questions

from blocktune.runtime.config import EngineConfig
from blocktune.runtime.engine import Engine
from blocktune.runtime.loading import load_pretrained
from blocktune.runtime.sampling import SamplingParams

KV_BYTES = 2**30
"""The KV pool of `bench/vs_vllm.py`'s worker command."""


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    """The token ids of the vs_vllm workload's first `count` questions, as chat prompts."""
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions(count)
    ]


def serve(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Serve `prompts` to completion; step CPU times by kind, CPU and wall time, tokens."""
    params = SamplingParams(max_tokens=max_tokens)
    ids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[int, list[int]] = {}
    prefill_steps, decode_steps = [], []
    start, cpu_start = time.perf_counter(), time.thread_time()
    while engine.has_unfinished():
        waiting = engine.stats()["waiting"]
        step_start = time.thread_time()
        outputs = engine.step()
        elapsed = time.thread_time() - step_start
        admitted = waiting - engine.stats()["waiting"]
        (prefill_steps if admitted else decode_steps).append(elapsed)
        for output in outputs:
            if output.finished:
                tokens[output.request_id] = output.token_ids
    return {
        "wall_s": time.perf_counter() - start,
        "cpu_s": time.thread_time() - cpu_start,
        "prefill_s": prefill_steps,
        "decode_s": decode_steps,
        "tokens": [tokens[i] for i in ids],
    }


def digest(tokens: list[list[int]]) -> str:
    """A short hash of every request's generated tokens."""
    return hashlib.sha256(repr(tokens).encode()).hexdigest()[:12]


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--model", default="smollm2", help="model to load")
    parser.add_argument("--dtype", nargs="+", default=["float32"], help="dtypes, in turn")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--block-size", type=int, default=32, help="the engine's block size")
    parser.add_argument("--requests", type=int, default=32, help="requests queued at once")
    parser.add_argument("--concurrency", type=int, default=8, help="most requests running")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens a request")
    parser.add_argument("--repeat", type=int, default=1, help="runs after a warm-up run")
    args = parser.parse_args()
    out = ResultFile(__file__, __doc__, args.results, preformatted=True)
    torch.set_num_threads(args.threads)
    reference = None
    for dtype in args.dtype:
        loaded = load_pretrained(args.model, dtype=dtype)
        prompts = chat_prompts(loaded.tokenizer, args.requests)
        config = EngineConfig(
            block_size=args.block_size, kv_bytes=KV_BYTES, max_num_seqs=args.concurrency
        )
        engine = Engine(loaded.model, config)
        serve(engine, prompts[:2], 4)  # warm-up
        lengths = sorted(len(p) for p in prompts)
        out.print(
            f"{args.model} {dtype}, {args.threads} thread(s), block {args.block_size}, "
            f"{args.requests} requests of {lengths[0]}-{lengths[-1]} prompt tokens, at most "
            f"{args.max_tokens} tokens each, concurrency {args.concurrency}"
        )
        for _ in range(args.repeat):
            run = serve(engine, prompts, args.max_tokens)
            output_tokens = sum(len(t) for t in run["tokens"])
            same = ""
            if reference is None:
                reference = run["tokens"]
            else:
                equal = sum(a == b for a, b in zip(run["tokens"], reference, strict=True))
                same = f"  {equal}/{len(prompts)} as {args.dtype[0]}"
            out.print(
                f"prefill step p50 {1e3 * statistics.median(run['prefill_s']):7.1f} ms  "
                f"decode step p50 {1e3 * statistics.median(run['decode_s']):6.1f} ms  "
                f"output {output_tokens / run['cpu_s']:6.1f} tok/CPU-s "
                f"{output_tokens / run['wall_s']:6.1f} tok/s  tokens {digest(run['tokens'])}" + same
            )
    out.write()


if __name__ == "__main__":
    main()
