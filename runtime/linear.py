"""A linear layer that multiplies through a oneDNN-packed copy of its weight on the CPU.

`torch.nn.functional.linear` hands the CPU's BLAS the weight in its checkpoint layout
on every call; oneDNN can instead reorder it once into the blocked layout its matrix
kernels read, which makes a decode step's small-batch products about twice as fast
here (bench/results/engine_speed.md). `PackedLinear` keeps the ordinary weight (for
state dicts, tied embeddings and other devices) and packs a copy the first time it
runs without autograd, so the weights take twice their memory; a new weight (a
`load_state_dict`, an in-place change, another device or dtype) is packed again. On a
GPU, in float16 and wherever oneDNN lacks the dtype it is a plain `nn.Linear`.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["PackedLinear", "packs"]


def packs(weight: torch.Tensor) -> bool:
    """Whether `PackedLinear` multiplies `weight` through a oneDNN-packed copy."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return weight.dtype == torch.float32


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
        # Inference tensors keep no version counter, but cannot change outside inference mode.
        version = None if weight.is_inference() else weight._version
        key = (weight.data_ptr(), weight.dtype, version)
        if key != self._packed_key:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            self._packed_key = key
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, None, "none", [], "")
