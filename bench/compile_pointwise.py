"""Does `torch.compile` pay for the engine's small per-layer operators on this CPU?

Times, on one thread, the two chains of pointwise operators every decoder layer runs
besides its products, at SmolLM2's widths (hidden 576, intermediate 1536) and a decode
batch of 1, 8 and 32 tokens: the residual add with the RMS norm that follows it
(`runtime/model.py:RMSNorm`), and SwiGLU's `silu(gate) * up`. Each is called eagerly and
as `torch.compile(..., dynamic=True)` (inductor, compiled once for every batch size), in
inference mode; prints microseconds per call, the ratio, and whether the compiled
result is bitwise equal to the eager one.

    python bench/compile_pointwise.py [--dtype bfloat16] [--calls 2000]
"""

from __future__ import annotations

import argparse
import time

import torch

from blocktune.runtime.model import RMSNorm

HIDDEN, INTERMEDIATE = 576, 1536  # SmolLM2-135M
EPS = 1e-5


def add_norm(x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """The residual add and the next layer norm, as a decoder layer runs them."""
    return norm(x + residual)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's pointwise part on the fused gate/up product."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def per_call_us(fn, args: tuple, calls: int) -> float:
    for _ in range(50):
        fn(*args)
    began = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter() - began) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", help="default: %(default)s")
    parser.add_argument("--calls", type=int, default=2000, help="default: %(default)s")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    norm = RMSNorm(HIDDEN, EPS).to(dtype)
    compiled = {
        "add + RMS norm": (add_norm, torch.compile(add_norm, dynamic=True)),
        "silu(gate) * up": (silu_mul, torch.compile(silu_mul, dynamic=True)),
    }
    print(f"{args.dtype}, one thread, {args.calls} calls each")
    print("| operators | tokens | eager µs | compiled µs | compiled / eager | bitwise equal |")
    print("| --- | --- | --- | --- | --- | --- |")
    with torch.inference_mode():
        for tokens in (1, 8, 32):
            x = torch.randn(tokens, HIDDEN, dtype=dtype)
            inputs = {
                "add + RMS norm": (x, torch.randn_like(x), norm),
                "silu(gate) * up": (torch.randn(tokens, 2 * INTERMEDIATE, dtype=dtype),),
            }
            for name, (eager, fast) in compiled.items():
                call = inputs[name]
                equal = torch.equal(eager(*call), fast(*call))
                slow_us = per_call_us(eager, call, args.calls)
                fast_us = per_call_us(fast, call, args.calls)
                print(
                    f"| {name} | {tokens} | {slow_us:.1f} | {fast_us:.1f} | "
                    f"{fast_us / slow_us:.2f} | {'yes' if equal else 'no'} |"
                )


if __name__ == "__main__":
    main()
