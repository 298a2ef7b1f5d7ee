"""Decode steps with fused projections against separate ones, alternating step by step.

Loads a model once, starts `--concurrency` requests of the `bench/vs_vllm.py` chat
workload (EOS ignored, so the batch stays whole) and times its decode steps by the
thread's CPU time, alternating every step between the model as it is (each layer's
query/key/value and gate/up products through one `FusedProjections` product) and the
same layers multiplied one by one and their outputs concatenated. Alternating within
one process leaves the machine's drift out of the ratio. Prints the median step of
each and their ratio, per dtype and concurrency.

    python bench/fused_projections.py [--model smollm2] [--dtype float32 bfloat16]
        [--concurrency 1 8 32] [--steps 60]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from steady_batch import chat_prompts, decoding_engine

from blocktune.runtime.loading import load_pretrained
from blocktune.runtime.model import MLP, Attention


class Separate:
    """The layers of a `FusedProjections`, multiplied one by one and concatenated."""

    def __init__(self, layers) -> None:
        self.layers = layers

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([layer(x) for layer in self.layers], dim=-1)


def fusions(model) -> list[tuple[object, str]]:
    """(module, attribute) of every `FusedProjections` in the model."""
    found = []
    for module in model.modules():
        if isinstance(module, Attention):
            found.append((module, "qkv"))
        elif isinstance(module, MLP):
            found.append((module, "gate_up"))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="default: %(default)s")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=60, help="timed steps (default: 60)")
    parser.add_argument("--threads", type=int, default=1, help="default: %(default)s")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for dtype in args.dtype:
        loaded = load_pretrained(args.model, dtype=dtype)
        fused = fusions(loaded.model)
        separate = [(m, name, Separate(getattr(m, name).layers)) for m, name in fused]
        originals = [(m, name, getattr(m, name)) for m, name in fused]
        prompts = chat_prompts(loaded.tokenizer, max(args.concurrency))
        for concurrency in args.concurrency:
            engine = decoding_engine(loaded.model, prompts[:concurrency], args.steps)
            times: dict[bool, list[float]] = {True: [], False: []}
            for step in range(args.steps):
                use_fused = step % 2 == 1
                for module, name, product in originals if use_fused else separate:
                    setattr(module, name, product)
                start = time.thread_time()
                engine.step()
                times[use_fused].append(time.thread_time() - start)
            for module, name, product in originals:
                setattr(module, name, product)
            one_by_one, together = (statistics.median(times[k]) for k in (False, True))
            print(
                f"{args.model} {dtype} concurrency {concurrency}: decode step p50 separate "
                f"{1e3 * one_by_one:.1f} ms, fused {1e3 * together:.1f} ms, "
                f"fused / separate {together / one_by_one:.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
