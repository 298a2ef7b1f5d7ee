"""Engine speed on a fixed workload: prefill and decode step times, output tokens per second.

The workload is the one `bench/vs_vllm.py` sends over HTTP, served here on the engine
directly (no HTTP, no tokenizer): `--requests` prompts of 30-35 seeded random token ids,
all queued at once, at most `--concurrency` running together, `--max-tokens` greedy
tokens each (EOS ignored). It prints the median prefill and decode step, the output
tokens per second of the whole run, and a digest of every generated token, so two
builds can be compared for speed and for identical output (run it once per build,
back to back, with `uptime` beside it). Steps are timed by the serving thread's CPU
time, which leaves out the waits for a core that other processes hold (with
`--threads 1` it is the step's whole cost); output tokens are counted per CPU-second
and per wall-clock second.

    python bench/engine_speed.py [--model smollm2] [--dtype float32] [--threads 1]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time

import torch

from blocktune.runtime.engine import Engine, EngineConfig, SamplingParams
from blocktune.runtime.loading import load_weights

PROMPT_TOKENS = (30, 35)  # the prompt lengths of the vs_vllm workload


def workload(requests: int, vocab: int, seed: int) -> list[list[int]]:
    """`requests` prompts of 30-35 random token ids (seeded)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(
        PROMPT_TOKENS[0], PROMPT_TOKENS[1] + 1, (requests,), generator=generator
    )
    return [torch.randint(0, vocab, (int(n),), generator=generator).tolist() for n in lengths]


def serve(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Serve `prompts` to completion; step times by kind, wall time and the tokens."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="default: %(default)s")
    parser.add_argument("--dtype", default="float32", help="default: %(default)s")
    parser.add_argument("--threads", type=int, default=1, help="default: %(default)s")
    parser.add_argument("--block-size", type=int, default=32, help="default: %(default)s")
    parser.add_argument("--requests", type=int, default=32, help="default: %(default)s")
    parser.add_argument("--concurrency", type=int, default=8, help="default: %(default)s")
    parser.add_argument("--max-tokens", type=int, default=64, help="default: %(default)s")
    parser.add_argument("--repeat", type=int, default=2, help="runs after a warm-up run")
    parser.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_weights(args.model, dtype=args.dtype)
    prompts = workload(args.requests, model.config.vocab_size, args.seed)
    config = EngineConfig(block_size=args.block_size, kv_bytes=2**30, max_num_seqs=args.concurrency)
    engine = Engine(model, config)
    serve(engine, prompts[:2], 4)  # warm-up
    print(
        f"{args.model} {args.dtype}, {args.threads} thread(s), block {args.block_size}, "
        f"{args.requests} requests x {args.max_tokens} tokens, concurrency {args.concurrency}"
    )
    for _ in range(args.repeat):
        run = serve(engine, prompts, args.max_tokens)
        output_tokens = sum(len(t) for t in run["tokens"])
        prefill_ms = 1e3 * statistics.median(run["prefill_s"])
        decode_ms = 1e3 * statistics.median(run["decode_s"])
        print(
            f"prefill step p50 {prefill_ms:7.1f} ms  decode step p50 {decode_ms:6.1f} ms  "
            f"output {output_tokens / run['cpu_s']:6.1f} tok/CPU-s "
            f"{output_tokens / run['wall_s']:6.1f} tok/s  tokens {digest(run['tokens'])}"
        )


if __name__ == "__main__":
    main()
