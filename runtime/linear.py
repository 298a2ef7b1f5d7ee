"""A linear layer that multiplies through a oneDNN-packed copy of its weight on the CPU.

`torch.nn.functional.linear` hands the CPU's BLAS the weight in its checkpoint layout
on every call; oneDNN can instead reorder it once into the blocked layout its matrix
kernels read, which makes a decode step's small-batch products about twice as fast
here (bench/results/engine_speed.md). `PackedLinear` keeps the ordinary weight (for
state dicts, tied embeddings and other devices) and packs a copy the first time it
runs without autograd, so the weights take twice their memory; a new weight (a
`load_state_dict`, an in-place change, another device or dtype) is packed again. On a
GPU, in float16 and without oneDNN it is a plain `nn.Linear`.

A bfloat16 weight on a CPU whose oneDNN has no bfloat16 kernels (no AVX-512) is packed
as float32 and its products computed in float32 from the bfloat16 input, then rounded to
bfloat16 once: what a bfloat16 product that sums in float32 computes (both factors are
exact in float32), at float32's speed where torch's own bfloat16 product on such a CPU
is 4-10x slower (see `packed_dtype`). Its packed copy takes twice the weight's memory
again.

`FusedProjections` multiplies several such layers that read the same input (a layer's
query, key and value projections; its gate and up projections) as one product through
one packed copy of their stacked weights: one larger matrix product instead of two or
three small ones, its result the layers' outputs side by side.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import torch
from torch import nn

__all__ = [
    "MIN_PRODUCT_ROWS",
    "STREAMED_WEIGHT_BYTES",
    "FusedProjections",
    "PackedLinear",
    "packs",
    "packed_dtype",
    "pads_few_rows",
]

MIN_PRODUCT_ROWS = 3
"""The fewest rows a product by a weight of `STREAMED_WEIGHT_BYTES` or more multiplies. With
its weights streamed from memory (a decode step), oneDNN's kernels for one and two rows read
them slower than its kernel for three: on an AVX-512 EPYC, one thread, 30 [3072, 576]
float32 weights took 531 / 635 us each for 1 / 2 rows and 478 us for 3, and a SmolLM2
decode step of two requests 51 ms where one of three took 40
(bench/results/engine_speed.md)."""

STREAMED_WEIGHT_BYTES = 512 * 2**10
"""The smallest weight whose products are padded to `MIN_PRODUCT_ROWS`: a model of weights
this large does not stay in the caches from one step to the next. The products of smaller
weights (a tiny test model's) are read from the cache, where one or two rows are as fast as
three and padding is only overhead (18% of a tiny model's decode step)."""


@cache
def pads_few_rows() -> bool:
    """Whether this CPU multiplies products of fewer than `MIN_PRODUCT_ROWS` rows as that many:
    where torch's CPU capability is AVX-512. On an AVX2 EPYC the padding made SmolLM2 decode
    steps of one / two requests 1.24x / 1.15x as long (bench/results/engine_speed.md)."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def packs(weight: torch.Tensor) -> bool:
    """Whether `PackedLinear` multiplies `weight` through a oneDNN-packed copy."""
    return (
        weight.device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and weight.dtype in (torch.float32, torch.bfloat16)
    )


def packed_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a packed weight of `dtype` is stored and multiplied in: float32 for a
    bfloat16 weight where oneDNN has no bfloat16 kernels (torch's CPU capability below
    AVX-512), else `dtype`. On an AVX2 EPYC, one thread, a [1536, 576] bfloat16 weight times
    8 / 47 rows took 1.87 / 12.2 ms through torch's bfloat16 product and 0.44 / 1.17 ms
    through a float32 copy (bench/results/engine_speed.md)."""
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.float32
    return dtype


class PackedLinear(nn.Linear):
    """`nn.Linear` (no bias) that runs inference through a packed copy of its weight."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        self._packed: torch.Tensor | None = None
        self._packed_key: tuple | None = None

    def __getstate__(self) -> dict:
        """Pickled without the packed copy (a oneDNN tensor, which cannot be pickled): it is
        a cache, which the first run after unpickling packs again."""
        return {**self.__dict__, "_packed": None, "_packed_key": None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if torch.is_grad_enabled() or not packs(weight):
            return nn.functional.linear(x, weight)
        key = weight_key(weight)
        if key != self._packed_key:
            self._packed = pack(weight)
            self._packed_key = key
        return multiply(x, self._packed)


class FusedProjections:
    """`PackedLinear` layers that read the same input, multiplied as one product.

    Calling it returns the layers' outputs side by side (`[..., sum of out_features]`),
    as `torch.cat` of calling them one by one would. Where the layers pack (see `packs`),
    it multiplies through one packed copy of their stacked weights, made again when any
    of them gets a new weight; elsewhere, and with autograd on, it calls the layers. It
    is not a module: the layers keep their weights and names.
    """

    def __init__(self, layers: Sequence[PackedLinear]) -> None:
        self.layers = tuple(layers)
        self._packed: torch.Tensor | None = None
        self._packed_key: tuple | None = None

    def __getstate__(self) -> dict:
        """Pickled without the packed copy, as `PackedLinear` is."""
        return {**self.__dict__, "_packed": None, "_packed_key": None}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights = [layer.weight for layer in self.layers]
        if torch.is_grad_enabled() or not packs(weights[0]):
            return torch.cat([layer(x) for layer in self.layers], dim=-1)
        key = tuple(weight_key(weight) for weight in weights)
        if key != self._packed_key:
            self._packed = pack(torch.cat([weight.detach() for weight in weights]))
            self._packed_key = key
        return multiply(x, self._packed)


def weight_key(weight: torch.Tensor) -> tuple:
    """What identifies a weight's values: its storage, dtype and version."""
    # Inference tensors keep no version counter, but cannot change outside inference mode.
    version = None if weight.is_inference() else weight._version
    return (weight.data_ptr(), weight.dtype, version)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A oneDNN-packed copy of `weight [out, in]`, in `packed_dtype`."""
    return torch.ops.mkldnn._reorder_linear_weight(
        weight.detach().to(packed_dtype(weight.dtype)), None
    )


def multiply(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """`x [..., in]` times a packed weight: `[..., out]`, in `x`'s dtype (computed in the
    packed weight's).

    On a CPU that `pads_few_rows`, a weight of `STREAMED_WEIGHT_BYTES` or more multiplies
    fewer than `MIN_PRODUCT_ROWS` rows as that many, the rest zeros: a decode step of one or
    two requests then reads the weights as fast as one of three."""
    if x.dtype != packed.dtype:
        return multiply(x.to(packed.dtype), packed).to(x.dtype)
    rows = x.numel() // x.shape[-1]
    if (
        rows == 0
        or rows >= MIN_PRODUCT_ROWS
        or not pads_few_rows()
        or packed.shape.numel() * packed.element_size() < STREAMED_WEIGHT_BYTES
    ):
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    padded = x.new_zeros(MIN_PRODUCT_ROWS, x.shape[-1])
    padded[:rows] = x.reshape(rows, -1)
    product = torch.ops.mkldnn._linear_pointwise(padded, packed, None, "none", [], "")
    return product[:rows].view(*x.shape[:-1], -1)
