"""Decode steps on two attention backends, alternating step by step in one process.

Loads a model once, starts `--concurrency` requests of the `bench/vs_vllm.py` chat
workload (EOS ignored, so the batch stays whole) on one engine per backend and times
their decode steps by the thread's CPU time, alternating every step between the engines
so the machine's drift falls on both alike. Prints the median step of each backend,
their ratio, and whether the two engines generated the same tokens.

    python bench/backend_split.py [--model smollm2] [--backends torch cpu]
        [--dtype float32 bfloat16] [--concurrency 8 32] [--steps 60] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from steady_batch import chat_prompts, decoding_engine

from blocktune.runtime.loading import load_pretrained


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="default: %(default)s")
    parser.add_argument("--backends", nargs=2, default=["torch", "cpu"])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--steps", type=int, default=60, help="steps per backend (default: 60)")
    parser.add_argument("--threads", type=int, default=1, help="default: %(default)s")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    first, second = args.backends
    for dtype in args.dtype:
        loaded = load_pretrained(args.model, dtype=dtype)
        prompts = chat_prompts(loaded.tokenizer, max(args.concurrency))
        for concurrency in args.concurrency:
            engines = {
                backend: decoding_engine(loaded.model, prompts[:concurrency], args.steps, backend)
                for backend in args.backends
            }
            times: dict[str, list[float]] = {backend: [] for backend in args.backends}
            outputs: dict[str, list] = {}
            for _ in range(args.steps):
                for backend, engine in engines.items():
                    start = time.thread_time()
                    outputs[backend] = engine.step()
                    times[backend].append(time.thread_time() - start)
            same = [a.token_ids for a in outputs[first]] == [b.token_ids for b in outputs[second]]
            a, b = (statistics.median(times[backend]) for backend in args.backends)
            print(
                f"{args.model} {dtype} concurrency {concurrency}: decode step p50 {first} "
                f"{1e3 * a:.1f} ms, {second} {1e3 * b:.1f} ms, {second}/{first} {b / a:.3f}; "
                f"tokens {'identical' if same else 'DIFFERENT'} after {args.steps} steps",
                flush=True,
            )


if __name__ == "__main__":
    main()
