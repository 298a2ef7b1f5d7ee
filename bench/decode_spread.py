"""Decode steps of a batch whose contexts are alike against one whose contexts are spread.

`STEP_FORM` prices a decode step by its sequences, their tokens and their blocks, so two
batches with the same of each cost the same in the simulator. The torch backend's decode
attention reads a batch in chunks of similar contexts (`kernels.paged_attention.DecodeLayout`),
one gather and one fused attention call per chunk and layer, so a batch of spread contexts
makes more, smaller calls. This times both on the engine: `--sequences` requests at
`--context` tokens each, and the same number with contexts spread evenly over
`--spread` (same mean), decoding, one thread, CPU time, `--steps` steps each after five to
settle, alternating `--rounds` times per block size; it prints the medians and their ratio.

    python bench/decode_spread.py [--model tiny-random] [--block-sizes 8 16 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from blocktune.runtime.config import EngineConfig
from blocktune.runtime.engine import Engine
from blocktune.runtime.loading import load_pretrained
from blocktune.runtime.sampling import SamplingParams

SETTLE_STEPS = 5


def decode_step_s(model, block_size: int, contexts: list[int], steps: int, seed: int) -> float:
    """The median CPU time of `steps` decode steps of requests with `contexts`-token prompts."""
    engine = Engine(model, EngineConfig(block_size=block_size, kv_bytes=2**30, max_num_seqs=1024))
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=SETTLE_STEPS + steps + 2, ignore_eos=True)
    vocab = model.config.vocab_size
    for length in contexts:
        engine.add_request(rng.integers(1, vocab, length).tolist(), params)
    while engine.stats()["waiting"]:
        engine.step()  # admissions and prefills
    times = []
    for _ in range(SETTLE_STEPS + steps):
        start = time.thread_time()
        engine.step()
        times.append(time.thread_time() - start)
    return statistics.median(times[SETTLE_STEPS:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-random", help="default: %(default)s")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[8, 16, 64])
    parser.add_argument("--sequences", type=int, default=64, help="default: %(default)s")
    parser.add_argument("--context", type=int, default=600, help="default: %(default)s")
    parser.add_argument(
        "--spread", type=int, nargs=2, default=[100, 1100], help="default: 100 1100"
    )
    parser.add_argument("--steps", type=int, default=20, help="default: %(default)s")
    parser.add_argument("--rounds", type=int, default=3, help="default: %(default)s")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = load_pretrained(args.model, dtype="float32").model
    alike = [args.context] * args.sequences
    spread = np.linspace(*args.spread, args.sequences).round().astype(int).tolist()
    print(
        f"{args.model}, {args.sequences} sequences: contexts {args.context} against "
        f"{args.spread[0]}-{args.spread[1]} (mean {statistics.mean(spread):.0f}), one thread"
    )
    for block_size in args.block_sizes:
        ratios = []
        for round_ in range(args.rounds):
            a = decode_step_s(model, block_size, alike, args.steps, round_)
            s = decode_step_s(model, block_size, spread, args.steps, round_)
            ratios.append(s / a)
            print(
                f"B={block_size:<3} round {round_ + 1}: alike {1e3 * a:6.2f} ms, "
                f"spread {1e3 * s:6.2f} ms, spread / alike {s / a:.2f}"
            )
        print(f"B={block_size:<3} median spread / alike {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
