"""Writes into and copies within the paged KV pool, in torch, in Triton and (writes) in C.

Each layer's K and V are flat slot tensors `[num_slots, num_kv_heads, head_dim]`;
block `j` of size `B` is slots `[j*B, (j+1)*B)`. As in `paged_attention`, values
(slot ids, block ids) are checked for CPU inputs only, since the check would cost
a device synchronisation on CUDA.
"""

from __future__ import annotations

import torch

from .cpu_library import cpu_library
from .paged_attention import (
    FLOAT_DTYPES,
    KernelInputError,
    check_backend,
    check_block_size,
    require_triton,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton publishes Linux wheels only; the torch backend still works.
    triton = None

__all__ = [
    "copy_blocks",
    "copy_blocks_torch",
    "copy_blocks_triton",
    "warmup_cache_ops",
    "write_kv",
    "write_kv_cpu",
    "write_kv_torch",
    "write_kv_triton",
]

COPY_CHUNK = 1024  # elements per program of the block-copy kernel


def _check_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor, where: str) -> None:
    if key_cache.dim() != 3:
        raise KernelInputError(f"{where}key_cache must be 3-D, got {tuple(key_cache.shape)}")
    if key_cache.dtype not in FLOAT_DTYPES:
        raise KernelInputError(f"{where}cache dtype must be one of {FLOAT_DTYPES}")
    if (
        key_cache.shape != value_cache.shape
        or key_cache.dtype != value_cache.dtype
        or key_cache.device != value_cache.device
    ):
        raise KernelInputError(
            f"{where}key_cache {tuple(key_cache.shape)} {key_cache.dtype} {key_cache.device} "
            f"and value_cache {tuple(value_cache.shape)} {value_cache.dtype} "
            f"{value_cache.device} differ"
        )


def _check_write_inputs(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    check_slots: bool,
) -> None:
    _check_cache_pair(key_cache, value_cache, "")
    for name, tensor in (("key", key), ("value", value)):
        if tensor.dim() != 3 or tensor.shape[1:] != key_cache.shape[1:]:
            raise KernelInputError(
                f"{name} must be [num_tokens, {key_cache.shape[1]}, {key_cache.shape[2]}], "
                f"got {tuple(tensor.shape)}"
            )
        if tensor.dtype != key_cache.dtype or tensor.device != key_cache.device:
            raise KernelInputError(
                f"{name} is {tensor.dtype} on {tensor.device}; the cache is "
                f"{key_cache.dtype} on {key_cache.device}"
            )
    if key.shape != value.shape:
        raise KernelInputError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
    if (
        slot_mapping.dim() != 1
        or slot_mapping.dtype not in (torch.int32, torch.int64)
        or slot_mapping.shape[0] != key.shape[0]
    ):
        raise KernelInputError(
            f"slot_mapping must be int32/int64 of shape [{key.shape[0]}], got "
            f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.device != key_cache.device:
        raise KernelInputError(
            f"slot_mapping is on {slot_mapping.device}, the cache on {key.device}"
        )
    if check_slots and slot_mapping.device.type == "cpu" and len(slot_mapping):
        bad = torch.nonzero((slot_mapping < 0) | (slot_mapping >= key_cache.shape[0]))
        if len(bad):
            token = int(bad[0, 0])
            raise KernelInputError(
                f"slot_mapping[{token}] = {int(slot_mapping[token])} is outside the pool's "
                f"{key_cache.shape[0]} slots"
            )
        if torch.unique(slot_mapping).numel() != len(slot_mapping):
            raise KernelInputError("slot_mapping names a slot more than once")


def write_kv_torch(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    check_slots: bool = True,
) -> None:
    """Write `key`/`value [num_tokens, num_kv_heads, head_dim]` into their slots, in place."""
    _check_write_inputs(key_cache, value_cache, key, value, slot_mapping, check_slots)
    slots = slot_mapping.long()
    key_cache.index_copy_(0, slots, key)
    value_cache.index_copy_(0, slots, value)


def write_kv_cpu(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    check_slots: bool = True,
) -> None:
    """`write_kv_torch` as one C call (`layer_ops.c:write_slots`) where each token's K and V
    heads are one run of memory (as in the slices of a fused QKV product), the caches are
    contiguous and the C library loads; `write_kv_torch` elsewhere."""
    _check_write_inputs(key_cache, value_cache, key, value, slot_mapping, check_slots)
    row = key_cache.shape[1] * key_cache.shape[2]
    library = cpu_library()
    if (
        isinstance(library, str)
        or key.device.type != "cpu"
        or not (key_cache.is_contiguous() and value_cache.is_contiguous())
        or any(t.stride(2) != 1 or t.stride(1) != t.shape[2] for t in (key, value))
    ):
        write_kv_torch(key_cache, value_cache, key, value, slot_mapping, check_slots=False)
        return
    slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.long()
    size = key.element_size()
    library.write_slots(
        key.data_ptr(),
        key.stride(0) * size,
        value.data_ptr(),
        value.stride(0) * size,
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        slots.contiguous().data_ptr(),
        key.shape[0],
        row * size,
    )


if triton is not None:

    @triton.jit(do_not_specialize=["num_slots", "stride_kt", "stride_vt"])
    def _write_kv_kernel(
        key_cache_ptr,
        value_cache_ptr,
        key_ptr,
        value_ptr,
        slot_mapping_ptr,
        num_slots,
        stride_kt,
        stride_kh,
        stride_kd,
        stride_vt,
        stride_vh,
        stride_vd,
        stride_cs,
        stride_ch,
        NUM_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEADS_PAD: tl.constexpr,
        DIM_PAD: tl.constexpr,
    ):
        # One program per token: all its KV heads at once.
        token = tl.program_id(0)
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        heads = tl.arange(0, HEADS_PAD)[:, None]
        dims = tl.arange(0, DIM_PAD)[None, :]
        mask = (heads < NUM_HEADS) & (dims < HEAD_DIM)
        # Out-of-range slots are never written (they are rejected up front on CPU).
        if (slot >= 0) & (slot < num_slots):
            key = tl.load(
                key_ptr + token * stride_kt + heads * stride_kh + dims * stride_kd, mask=mask
            )
            value = tl.load(
                value_ptr + token * stride_vt + heads * stride_vh + dims * stride_vd, mask=mask
            )
            target = slot * stride_cs + heads * stride_ch + dims
            tl.store(key_cache_ptr + target, key, mask=mask)
            tl.store(value_cache_ptr + target, value, mask=mask)

    @triton.jit(do_not_specialize=["block_elems"])
    def _copy_blocks_kernel(cache_ptr, pairs_ptr, block_elems, CHUNK: tl.constexpr):
        # Program (pair, chunk) copies CHUNK elements of block src into block dst.
        pair = tl.program_id(0)
        offsets = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
        mask = offsets < block_elems
        src = tl.load(pairs_ptr + 2 * pair).to(tl.int64)
        dst = tl.load(pairs_ptr + 2 * pair + 1).to(tl.int64)
        data = tl.load(cache_ptr + src * block_elems + offsets, mask=mask)
        tl.store(cache_ptr + dst * block_elems + offsets, data, mask=mask)

else:
    _write_kv_kernel = None
    _copy_blocks_kernel = None


def write_kv_triton(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    check_slots: bool = True,
) -> None:
    """`write_kv_torch` as one Triton program per token."""
    _check_write_inputs(key_cache, value_cache, key, value, slot_mapping, check_slots)
    require_triton(key_cache.device)
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.stride(2) != 1 or cache.stride() != key_cache.stride():
            raise KernelInputError(f"{name} must be contiguous in head_dim, strided like key_cache")
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key_cache,
        value_cache,
        key,
        value,
        slot_mapping,
        key_cache.shape[0],
        *key.stride(),
        *value.stride(),
        key_cache.stride(0),
        key_cache.stride(1),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
    )


def write_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    backend: str = "torch",
    check_slots: bool = True,
) -> None:
    """Write the new tokens' K/V into the flat caches at `slot_mapping`, in place.

    On CPU tensors the slots are checked to be in the pool and distinct unless
    `check_slots` is False: a caller writing the same slots into every layer's caches
    checks them once."""
    check_backend(backend)
    write = {"triton": write_kv_triton, "cpu": write_kv_cpu}.get(backend, write_kv_torch)
    write(key_cache, value_cache, key, value, slot_mapping, check_slots=check_slots)


def _check_copy_inputs(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    pairs: list[tuple[int, int]] | torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """Validate and return the pairs as an int64 `[num_pairs, 2]` tensor on the caches' device."""
    check_block_size(block_size)
    if not key_caches or len(key_caches) != len(value_caches):
        raise KernelInputError(
            f"need one value cache per key cache (at least one), got {len(key_caches)} "
            f"and {len(value_caches)}"
        )
    first = key_caches[0]
    for layer, (key_cache, value_cache) in enumerate(zip(key_caches, value_caches, strict=True)):
        _check_cache_pair(key_cache, value_cache, f"layer {layer}: ")
        if key_cache.shape != first.shape or key_cache.device != first.device:
            raise KernelInputError(
                f"layer {layer}: cache {tuple(key_cache.shape)} on {key_cache.device} differs "
                f"from layer 0's {tuple(first.shape)} on {first.device}"
            )
    if first.shape[0] % block_size:
        raise KernelInputError(
            f"block_size {block_size} does not divide the pool's {first.shape[0]} slots"
        )
    table = pairs if isinstance(pairs, torch.Tensor) else torch.tensor(pairs, dtype=torch.int64)
    if table.numel() == 0:
        return table.reshape(0, 2).to(device=first.device, dtype=torch.int64)
    if table.dim() != 2 or table.shape[1] != 2 or table.is_floating_point():
        raise KernelInputError(
            f"pairs must be (src, dst) integer pairs, got {table.dtype} {tuple(table.shape)}"
        )
    if table.device.type == "cpu":
        _check_pair_values(table, first.shape[0] // block_size)
    return table.to(device=first.device, dtype=torch.int64).contiguous()


def _check_pair_values(table: torch.Tensor, num_blocks: int) -> None:
    bad = torch.nonzero((table < 0) | (table >= num_blocks))
    if len(bad):
        row, col = (int(i) for i in bad[0])
        raise KernelInputError(
            f"pairs[{row}] = {tuple(table[row].tolist())}: block {int(table[row, col])} is "
            f"outside the pool's {num_blocks} blocks"
        )
    sources, targets = table[:, 0], table[:, 1]
    if torch.unique(targets).numel() != len(targets):
        raise KernelInputError("pairs copy into the same destination block more than once")
    overlap = torch.isin(targets, sources)
    if overlap.any():
        row = int(torch.nonzero(overlap)[0, 0])
        raise KernelInputError(
            f"pairs[{row}] = {tuple(table[row].tolist())}: a destination block is also a source"
        )


def copy_blocks_torch(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    pairs: list[tuple[int, int]] | torch.Tensor,
    *,
    block_size: int,
) -> None:
    """For every layer, copy each `(src, dst)` block's slots in place, all pairs at once."""
    table = _check_copy_inputs(key_caches, value_caches, pairs, block_size)
    if not len(table):
        return
    offsets = torch.arange(block_size, device=table.device)
    src_slots = (table[:, :1] * block_size + offsets).reshape(-1)
    dst_slots = (table[:, 1:] * block_size + offsets).reshape(-1)
    for cache in (*key_caches, *value_caches):
        cache.index_copy_(0, dst_slots, cache.index_select(0, src_slots))


def copy_blocks_triton(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    pairs: list[tuple[int, int]] | torch.Tensor,
    *,
    block_size: int,
) -> None:
    """`copy_blocks_torch` as a Triton kernel per cache tensor; caches must be contiguous."""
    table = _check_copy_inputs(key_caches, value_caches, pairs, block_size)
    require_triton(key_caches[0].device)
    if not all(cache.is_contiguous() for cache in (*key_caches, *value_caches)):
        raise KernelInputError("copy_blocks with backend 'triton' needs contiguous caches")
    if not len(table):
        return
    block_elems = block_size * key_caches[0].stride(0)
    grid = (len(table), triton.cdiv(block_elems, COPY_CHUNK))
    for cache in (*key_caches, *value_caches):
        _copy_blocks_kernel[grid](cache, table, block_elems, CHUNK=COPY_CHUNK)


def copy_blocks(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    pairs: list[tuple[int, int]] | torch.Tensor,
    *,
    block_size: int,
    backend: str = "torch",
) -> None:
    """Copy block `src` to block `dst` for every `(src, dst)` pair in every layer, in place.

    Destinations must be distinct and must not be sources (copy-on-write and the
    hot-swap only copy into free blocks), so the order of the copies does not matter.
    """
    check_backend(backend)
    copy = copy_blocks_triton if backend == "triton" else copy_blocks_torch
    copy(key_caches, value_caches, pairs, block_size=block_size)


def warmup_cache_ops(
    *,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    backend: str = "triton",
) -> None:
    """Compile the write and copy kernels ahead of use (both serve every block size);
    a no-op for the torch and cpu backends (which write and copy with torch)."""
    check_backend(backend)
    if backend != "triton":
        return
    cache = torch.zeros((4, num_kv_heads, head_dim), dtype=dtype, device=device)
    for index_dtype in (torch.int32, torch.int64):
        slots = torch.zeros(1, dtype=index_dtype, device=device)
        write_kv_triton(cache, cache.clone(), cache[:1], cache[:1], slots)
    copy_blocks_triton([cache], [cache.clone()], [(0, 1)], block_size=2)
