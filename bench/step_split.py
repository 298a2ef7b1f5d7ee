"""How much of a decode step is the weight products: steps with and without them, alternating.

Loads a model once, starts `--concurrency` requests of the `bench/vs_vllm.py` chat
workload (EOS ignored, so the batch stays whole) and times its decode steps by the
thread's CPU time, alternating every step between the engine as it is and the same engine
with every packed product (`runtime.linear.multiply`: the projections and the output
head) replaced by a zero tensor of the product's shape. Alternating within one process
leaves the machine's drift out of the split. The tokens of the steps without products are
garbage (zero logits); only their time counts. Prints the median step of each and the
products' share, per dtype and concurrency.

    python bench/step_split.py [--model smollm2] [--dtype float32 bfloat16]
        [--concurrency 8 32] [--steps 60]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from steady_batch import chat_prompts, decoding_engine

from blocktune.runtime import linear
from blocktune.runtime.loading import load_pretrained


class NoProducts:
    """Stands in for `linear.multiply`: a zero tensor of the product's output shape."""

    def __init__(self, multiply) -> None:
        self.multiply = multiply
        self.widths: dict[int, int] = {}

    def __call__(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        width = self.widths.get(id(packed))
        if width is None:
            width = self.widths[id(packed)] = self.multiply(x[:1], packed).shape[-1]
        return torch.zeros(*x.shape[:-1], width, dtype=x.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="default: %(default)s")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--steps", type=int, default=60, help="timed steps (default: 60)")
    parser.add_argument("--threads", type=int, default=1, help="default: %(default)s")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    real = linear.multiply
    stub = NoProducts(real)
    for dtype in args.dtype:
        loaded = load_pretrained(args.model, dtype=dtype)
        prompts = chat_prompts(loaded.tokenizer, max(args.concurrency))
        for concurrency in args.concurrency:
            engine = decoding_engine(loaded.model, prompts[:concurrency], args.steps)
            times: dict[bool, list[float]] = {True: [], False: []}
            try:
                for step in range(args.steps):
                    with_products = step % 2 == 1
                    linear.multiply = real if with_products else stub
                    start = time.thread_time()
                    engine.step()
                    times[with_products].append(time.thread_time() - start)
            finally:
                linear.multiply = real
            whole, rest = (statistics.median(times[k]) for k in (True, False))
            print(
                f"{args.model} {dtype} concurrency {concurrency}: decode step p50 "
                f"{1e3 * whole:.1f} ms, without the products {1e3 * rest:.1f} ms, "
                f"products {1e3 * (whole - rest):.1f} ms ({(whole - rest) / whole:.0%})",
                flush=True,
            )


if __name__ == "__main__":
    main()
