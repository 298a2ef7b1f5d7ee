"""Decode step time by the number of requests in the batch, with and without row padding.

`runtime.linear.multiply` multiplies fewer than `MIN_PRODUCT_ROWS` rows as that many (the
rest zeros), because oneDNN's kernels for one to three rows read a weight streamed from
memory slower than its kernel for four. This decodes `--batch-sizes` requests of the
`bench/vs_vllm.py` workload, each on a fresh engine, one thread, and times `--steps`
decode steps by CPU time, alternating the padded products with unpadded ones
(`MIN_PRODUCT_ROWS` set to 1) `--rounds` times; it prints each median step and the
padded/unpadded ratio, and whether the two produced the same tokens.

    python bench/decode_batch_sizes.py [--model smollm2] [--dtype float32] [--batch-sizes 1 2 3 4 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from steady_batch import chat_prompts, decoding_engine

from blocktune.runtime import linear
from blocktune.runtime.loading import load_pretrained


def decode(model, prompts: list[list[int]], steps: int) -> tuple[float, list[list[int]]]:
    """Median CPU seconds of `steps` decode steps of `prompts` together, and their tokens."""
    engine = decoding_engine(model, prompts, steps)
    times, tokens = [], {}
    for _ in range(steps):
        start = time.thread_time()
        outputs = engine.step()
        times.append(time.thread_time() - start)
        for output in outputs:
            tokens.setdefault(output.request_id, []).append(output.token_ids[-1])
    return statistics.median(times), [tokens[i] for i in sorted(tokens)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="default: %(default)s")
    parser.add_argument("--dtype", default="float32", help="default: %(default)s")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 3, 4, 8])
    parser.add_argument("--steps", type=int, default=30, help="default: %(default)s")
    parser.add_argument("--rounds", type=int, default=3, help="default: %(default)s")
    args = parser.parse_args()
    torch.set_num_threads(1)
    loaded = load_pretrained(args.model, dtype=args.dtype)
    prompts = chat_prompts(loaded.tokenizer, max(args.batch_sizes))
    padded_rows = linear.MIN_PRODUCT_ROWS
    print(f"{args.model} {args.dtype}, one thread, block 32, {args.steps} decode steps a run")
    print("requests | padded step p50 | unpadded step p50 | ratio | same tokens")
    for size in args.batch_sizes:
        times: dict[int, list[float]] = {padded_rows: [], 1: []}
        tokens: dict[int, list[list[int]]] = {}
        for _ in range(args.rounds):
            for rows in times:
                linear.MIN_PRODUCT_ROWS = rows
                seconds, tokens[rows] = decode(loaded.model, prompts[:size], args.steps)
                times[rows].append(seconds)
        linear.MIN_PRODUCT_ROWS = padded_rows
        padded, unpadded = (statistics.median(times[rows]) for rows in (padded_rows, 1))
        print(
            f"{size} | {1e3 * padded:.1f} ms | {1e3 * unpadded:.1f} ms | "
            f"{padded / unpadded:.2f} | {tokens[padded_rows] == tokens[1]}"
        )


if __name__ == "__main__":
    main()
