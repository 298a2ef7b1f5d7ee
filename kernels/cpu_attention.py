"""Decode attention on the CPU that reads the paged KV cache in place: the "cpu" backend.

The torch backend gathers every decode sequence's blocks into a padded buffer and runs
torch's fused attention over it, once per chunk of sequences; at one query row per
sequence that costs more than the attention itself. This backend calls a small C kernel
(`paged_decode.c`, beside this module, in the library `blocktune.kernels.cpu_library`
builds) that walks each sequence's block table and reads K and V where they lie: no
copy, no padding, one call per layer. It reads the queries where they lie too (rows may
be apart, as in a fused query/key/value product) and writes its output in their dtype.

`default_backend(device)` picks "triton" on CUDA, "cpu" where the kernel loads and
"torch" otherwise. Float32 and bfloat16 caches are read natively; float16 ones go
through the torch backend.
"""

from __future__ import annotations

import math

import torch

from blocktune.kernels.cpu_library import cpu_kernel_error, cpu_library

__all__ = ["CPU_DTYPES", "default_backend", "paged_attention_cpu"]

CPU_DTYPES = (torch.float32, torch.bfloat16)  # caches the kernel reads in place


def default_backend(device: torch.device | str) -> str:
    """The fastest attention backend for `device`: "triton" on CUDA, "cpu" on a CPU where
    the C kernel builds, else "torch"."""
    if torch.device(device).type == "cuda":
        return "triton"
    return "cpu" if cpu_kernel_error() is None else "torch"


def paged_attention_cpu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    block_size: int,
    scale: float | None = None,
    table_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of `query [rows, num_heads, head_dim]` over one layer's paged cache, read
    in place by the C kernel; returns `[rows, num_heads, head_dim]` in `query.dtype`.

    Row `i` attends the first `context_lens[i]` tokens of block-table row `table_rows[i]`
    (int32; row `i` where None): a decode token its whole context; the tokens of a prefill
    chunk, each up to itself, can share their sequence's row (with `block_size` 1 the
    table rows are slot lists). Inputs are CPU tensors the caller has checked (shapes,
    dtypes in `CPU_DTYPES`, contiguous caches, lengths within the table and the pool).
    """
    library = cpu_library()
    if isinstance(library, str):
        raise RuntimeError(f"the cpu attention kernel is unavailable: {library}")
    num_rows, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    dtype = query.dtype
    # Each row's heads must be one run of values; rows may lie apart.
    if query.dtype != key_cache.dtype or query[0:1].stride()[1:] != (head_dim, 1):
        query = query.to(key_cache.dtype).contiguous()
    out = torch.empty(num_rows, num_heads, head_dim, dtype=key_cache.dtype)
    table = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    lens = context_lens.contiguous()
    rows = None if table_rows is None else table_rows.contiguous()
    status = library.paged_decode(
        query.data_ptr(),
        query.stride(0),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        int(key_cache.dtype == torch.bfloat16),
        table.data_ptr(),
        table.stride(0),
        None if rows is None else rows.data_ptr(),
        lens.data_ptr(),
        num_rows,
        num_kv_heads,
        num_heads // num_kv_heads,
        head_dim,
        block_size,
        scale,
        torch.get_num_threads(),
        out.data_ptr(),
        num_heads * head_dim,
    )
    if status:
        raise MemoryError("the cpu attention kernel could not allocate its score buffer")
    return out.to(dtype)
