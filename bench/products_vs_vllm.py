"""The weight products of a decode step: the engine's oneDNN-packed product against vLLM's.

vLLM's CPU build multiplies an unquantized linear layer through its own oneDNN matmul
handle (`vllm._custom_ops.create_onednn_mm` / `onednn_mm`); blocktune's engine through
torch's oneDNN-packed inner product (`torch.ops.mkldnn._linear_pointwise` on a weight
reordered once, `runtime/linear.py`). This times both on the same random weights of
SmolLM2-135M's shapes (30 layers of fused q/k/v, o, fused gate/up and down projections),
cold in the caches as in a decode step, alternating pass by pass, one thread. It needs
vLLM, so it runs with the vLLM venv's python (`make vllm`), which has the same torch:

    .venv-vllm/bin/python bench/products_vs_vllm.py [--dtype float32 bfloat16] [--batch 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

LAYERS = 30
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
"""(out, in) of a SmolLM2-135M layer's fused q/k/v, o, fused gate/up and down products."""


def one_pass(multiply, products: list[list[object]], inputs: dict[int, torch.Tensor]) -> float:
    """Seconds to multiply every layer's products (`multiply(x, product)`) once."""
    start = time.perf_counter()
    for layer in products:
        for product, (_, k) in zip(layer, SHAPES, strict=True):
            multiply(inputs[k], product)
    return time.perf_counter() - start


def main() -> None:
    from vllm import _custom_ops as ops

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, nargs="+", default=[8], help="rows (default: 8)")
    parser.add_argument("--passes", type=int, default=8, help="passes each (default: 8)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sides = {
        "vLLM onednn_mm": (
            lambda w: ops.create_onednn_mm(w.t(), 32),
            lambda x, handle: ops.onednn_mm(handle, x, None),
        ),
        "engine packed": (
            lambda w: torch.ops.mkldnn._reorder_linear_weight(w, None),
            lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
        ),
    }
    for name in args.dtype:
        dtype = getattr(torch, name)
        weights = [
            [torch.randn(n, k, dtype=dtype) * 0.02 for n, k in SHAPES] for _ in range(LAYERS)
        ]
        products = {
            label: [[prepare(w) for w in layer] for layer in weights]
            for label, (prepare, _) in sides.items()
        }
        megabytes = sum(n * k for n, k in SHAPES) * LAYERS * weights[0][0].element_size() / 1e6
        for batch in args.batch:
            inputs = {k: torch.randn(batch, k, dtype=dtype) for _, k in SHAPES}
            times: dict[str, list[float]] = {label: [] for label in sides}
            for _ in range(args.passes):
                for label, (_, multiply) in sides.items():
                    times[label].append(one_pass(multiply, products[label], inputs))
            medians = {label: statistics.median(t) for label, t in times.items()}
            ratio = medians["engine packed"] / medians["vLLM onednn_mm"]
            print(
                f"{name} batch {batch}, {megabytes:.0f} MB of weights: "
                + ", ".join(
                    f"{label} {1e3 * s:.1f} ms ({megabytes / 1e3 / s:.1f} GB/s)"
                    for label, s in medians.items()
                )
                + f"; engine / vLLM {ratio:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
