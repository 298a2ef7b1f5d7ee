"""The KV pool: per layer, K and V as flat token-slot tensors.

A block of size B with id j is slots `[j*B, (j+1)*B)`, so the block size is
only a view of the same memory (docs/architecture.md, "The KV pool is a flat
slot array"): `view(layer, B)` gives
`[num_slots // B, B, num_kv_heads, head_dim]` without copying.

Memory (the source article's formula omits layers and GQA):

    KV bytes = 2 (K and V) x num_layers x num_kv_heads x head_dim x dtype_bytes x slots
"""

from __future__ import annotations

import math
import mmap

import torch

__all__ = ["KVCache", "kv_bytes", "slots_for_budget"]


def kv_bytes(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int, num_slots: int
) -> int:
    """Bytes of K and V for `num_slots` token slots across all layers."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes * num_slots


def slots_for_budget(
    budget_bytes: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    align: int = 1,
) -> int:
    """The most token slots (a multiple of `align`) whose K and V fit in `budget_bytes`."""
    per_slot = kv_bytes(num_layers, num_kv_heads, head_dim, dtype_bytes, 1)
    return budget_bytes // per_slot // align * align


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zeroed tensor. On a CPU its memory is an anonymous memory map, which the system
    fills with zero pages lazily: a pool takes memory, and the time to clear it, only where
    K/V are written, not its whole budget at start-up (a 3.5 GiB pool otherwise costs seconds
    of page faults and all of its memory before the first request). The map asks for small
    pages (numpy's `zeros` asks for huge ones on large arrays, and where the system compacts
    memory to find one on the first write, the first K/V written into a fresh part of the
    pool cost milliseconds per layer: a step of 31 new prompts, 0.38 s of its 0.99 s). It is
    private, as malloc's maps are (Python's default is a shared one), so that a server that
    faults its whole pool in (`KVCache.fault_in`) can still have it moved into huge pages
    (`runtime.huge_pages`, which advises them first)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if hasattr(mmap, "MAP_PRIVATE"):
        memory = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    else:
        memory = mmap.mmap(-1, max(nbytes, 1))
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        memory.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(memory, dtype=torch.uint8)[:nbytes].view(dtype).view(shape)


class KVCache:
    """K and V of every layer as flat slot tensors `[num_slots, num_kv_heads, head_dim]`."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_slots: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if min(num_layers, num_kv_heads, head_dim, num_slots) <= 0:
            raise ValueError(
                "num_layers, num_kv_heads, head_dim and num_slots must be positive, got "
                f"{num_layers}, {num_kv_heads}, {head_dim}, {num_slots}"
            )
        shape = (num_slots, num_kv_heads, head_dim)
        self.num_slots = num_slots
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.k = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.v = [_zeros(shape, dtype, device) for _ in range(num_layers)]

    @classmethod
    def from_budget(
        cls,
        budget_bytes: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        align: int = 1,
    ) -> KVCache:
        """The largest pool (slots a multiple of `align`) that fits in `budget_bytes`."""
        dtype_bytes = torch.empty((), dtype=dtype).element_size()
        slots = slots_for_budget(
            budget_bytes, num_layers, num_kv_heads, head_dim, dtype_bytes, align
        )
        if slots == 0:
            raise ValueError(
                f"a KV budget of {budget_bytes} bytes holds no block of {align} slots for "
                f"{num_layers} layers x {num_kv_heads} KV heads x {head_dim} dims"
            )
        return cls(num_layers, num_kv_heads, head_dim, slots, dtype, device)

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def num_blocks(self, block_size: int) -> int:
        return self.num_slots // block_size

    def fault_in(self) -> None:
        """Make the whole pool resident (the memory map gives it pages only where written) by
        writing every value back as it is: a server that keeps its pool can then have it
        moved into huge pages (`runtime.huge_pages`), and its steps no longer fault on
        fresh pages."""
        for tensor in self.k + self.v:
            tensor.mul_(1)

    def view(self, layer: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as `[num_blocks, block_size, num_kv_heads, head_dim]` views."""
        if self.num_slots % block_size:
            raise ValueError(
                f"block size {block_size} does not divide the pool's {self.num_slots} slots"
            )
        shape = (self.num_slots // block_size, block_size, self.num_kv_heads, self.head_dim)
        return self.k[layer].view(shape), self.v[layer].view(shape)
