"""Decode attention over a paged KV cache: a torch reference, a Triton kernel and, on the
CPU, a C kernel that reads the blocks in place (`blocktune.kernels.cpu_attention`).

The KV pool of one layer is a flat slot tensor `[num_slots, num_kv_heads, head_dim]`;
block `j` of size `B` is slots `[j*B, (j+1)*B)`. Token `t` of sequence `s` lives in
slot `block_table[s, t // B] * B + t % B`. Both backends translate addresses that
way; the Triton kernel does it per token tile inside the kernel, with the KV block
size and the token tile size as separate constexprs (an 8-token block does not
force an 8-token tile).

Values (context lengths, block ids) are checked for CPU tensors only: on CUDA that
check would cost a device synchronisation per call, and the engine's block manager
already guarantees them. Shapes, dtypes and devices are always checked.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from blocktune.kernels import is_power_of_two
from blocktune.kernels.cpu_attention import CPU_DTYPES, paged_attention_cpu
from blocktune.kernels.cpu_library import cpu_kernel_error

try:
    import triton
    import triton.language as tl
    from triton.runtime.jit import JITFunction
except ImportError:  # Triton publishes Linux wheels only; the torch backend still works.
    triton = None

__all__ = [
    "BACKENDS",
    "DecodeLayout",
    "KernelInputError",
    "check_backend",
    "check_block_size",
    "decode_layout",
    "default_tile_size",
    "paged_attention",
    "paged_attention_torch",
    "paged_attention_triton",
    "require_cpu_kernel",
    "require_triton",
    "warmup",
]

BACKENDS = ("torch", "triton", "cpu")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Tokens per split-K partition on CUDA when there are too few (sequence, KV head) pairs
# to fill the device; a multiple of every supported tile size.
DEFAULT_PARTITION = 512
MIN_DOT = 16  # tl.dot needs every matrix dimension >= 16 (tiles, head_dim, padded group)
MAX_TILE = 256
MAX_HEAD_DIM = 256
# fp32 K and V the torch backend gathers per chunk of sequences, per CPU thread: small
# enough to be read back from the CPU caches, large enough that the chunks' own overhead
# stays small (the fastest on a 2-core machine at 1 and 2 threads).
GATHER_BYTES_PER_THREAD = 4 << 20
# A decode sequence shares a chunk (and its padding to the chunk's longest context) while
# that context is at most PAD_RATIO times its own or PAD_TOKENS longer: gathering that
# much padding costs less than another gather and attention call per layer.
PAD_RATIO = 2
PAD_TOKENS = 256


class KernelInputError(ValueError):
    """A kernel got inputs it cannot handle (shape, dtype, device, backend or value)."""


def check_block_size(block_size: int) -> None:
    """Raise `KernelInputError` unless `block_size` is a power-of-two int."""
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise KernelInputError(f"block_size must be an int, got {block_size!r}")
    if not is_power_of_two(block_size):
        raise KernelInputError(f"block_size must be a power of two, got {block_size}")


def check_backend(backend: str) -> None:
    """Raise `KernelInputError` naming `backend` unless it is one of `BACKENDS`."""
    if backend not in BACKENDS:
        raise KernelInputError(f"unknown backend {backend!r}; expected one of {BACKENDS}")


def require_triton(device: torch.device | str) -> None:
    """Raise `KernelInputError` unless this process can run the Triton kernels on `device`.

    Compiled kernels need CUDA tensors; CPU tensors work only when the kernels were
    defined under the Triton interpreter (`TRITON_INTERPRET=1` set before
    `blocktune.kernels` is first imported).
    """
    if triton is None:
        raise KernelInputError("backend 'triton' needs the triton package (Linux only)")
    device = torch.device(device)
    if device.type != "cuda" and isinstance(_paged_attention_kernel, JITFunction):
        raise KernelInputError(
            f"backend 'triton' got {device.type} tensors: compiled Triton kernels need CUDA; "
            "on a CPU set TRITON_INTERPRET=1 before blocktune.kernels is first imported"
        )


def _check_attention_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    check_values: bool = True,
) -> None:
    check_block_size(block_size)
    for name, tensor in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        if tensor.dim() != 3:
            raise KernelInputError(f"{name} must be 3-D, got shape {tuple(tensor.shape)}")
        if tensor.dtype not in FLOAT_DTYPES:
            raise KernelInputError(
                f"{name} dtype must be one of {FLOAT_DTYPES}, got {tensor.dtype}"
            )
        if tensor.device != query.device:
            raise KernelInputError(f"{name} is on {tensor.device}, query on {query.device}")
    if key_cache.shape != value_cache.shape or key_cache.dtype != value_cache.dtype:
        raise KernelInputError(
            f"key_cache {tuple(key_cache.shape)} {key_cache.dtype} and value_cache "
            f"{tuple(value_cache.shape)} {value_cache.dtype} differ"
        )
    if query.dtype != key_cache.dtype:
        raise KernelInputError(f"query dtype {query.dtype} differs from cache {key_cache.dtype}")
    num_seqs, num_heads, head_dim = query.shape
    _, num_kv_heads, cache_head_dim = key_cache.shape
    if cache_head_dim != head_dim:
        raise KernelInputError(f"query head_dim {head_dim} != cache head_dim {cache_head_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise KernelInputError(
            f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
        )
    for name, tensor, dims in (("block_table", block_table, 2), ("context_lens", context_lens, 1)):
        if tensor.dim() != dims or tensor.dtype != torch.int32:
            raise KernelInputError(
                f"{name} must be a {dims}-D int32 tensor, got {tensor.dtype} "
                f"of shape {tuple(tensor.shape)}"
            )
        if tensor.shape[0] != num_seqs:
            raise KernelInputError(f"{name} has {tensor.shape[0]} rows for {num_seqs} sequences")
        if tensor.device != query.device:
            raise KernelInputError(f"{name} is on {tensor.device}, query on {query.device}")
    if check_values and query.device.type == "cpu" and num_seqs:
        _check_attention_values(block_table, context_lens, block_size, key_cache.shape[0])


def _check_attention_values(
    block_table: torch.Tensor, context_lens: torch.Tensor, block_size: int, num_slots: int
) -> None:
    capacity = block_table.shape[1] * block_size
    num_blocks = num_slots // block_size
    shortest, longest = (int(n) for n in torch.aminmax(context_lens))
    if shortest >= 1 and longest <= capacity:
        used = torch.arange(block_table.shape[1]) * block_size < context_lens[:, None]
        lowest, highest = (int(n) for n in torch.aminmax(block_table.where(used, 0)))
        if lowest >= 0 and highest < num_blocks:
            return
    _raise_bad_values(block_table, context_lens, block_size, num_blocks)


def _raise_bad_values(
    block_table: torch.Tensor, context_lens: torch.Tensor, block_size: int, num_blocks: int
) -> None:
    """Raise `KernelInputError` naming the first bad context length or used block id."""
    capacity = block_table.shape[1] * block_size
    short = torch.nonzero(context_lens < 1)
    if len(short):
        seq = int(short[0, 0])
        raise KernelInputError(f"context_lens[{seq}] = {int(context_lens[seq])}; must be >= 1")
    long = torch.nonzero(context_lens > capacity)
    if len(long):
        seq = int(long[0, 0])
        raise KernelInputError(
            f"context_lens[{seq}] = {int(context_lens[seq])} exceeds the block table's "
            f"{block_table.shape[1]} blocks of {block_size} tokens"
        )
    used = torch.arange(block_table.shape[1]) * block_size < context_lens[:, None]
    seq, col = (
        int(i) for i in torch.nonzero(used & ((block_table < 0) | (block_table >= num_blocks)))[0]
    )
    raise KernelInputError(
        f"block_table[{seq}, {col}] = {int(block_table[seq, col])} is outside the pool's "
        f"{num_blocks} blocks of {block_size} slots"
    )


@dataclass(frozen=True)
class _Chunk:
    rows: torch.Tensor  # the batch rows it attends, [n] int64
    blocks: torch.Tensor  # their blocks, [n, blocks]; 0 past a context
    mask: torch.Tensor | None  # [n, 1, 1, max_len], True where a token is in the context
    max_len: int
    block_size: int


@dataclass(frozen=True)
class DecodeLayout:
    """How the torch backend reads one decode batch's K/V, worked out once for all layers.

    The sequences, longest context first, go in chunks; each chunk gathers its blocks
    padded only to its own longest context, so a short sequence never pays for a long
    one's context: a sequence joins a chunk while the chunk's longest context is at
    most `PAD_RATIO` times its own or `PAD_TOKENS` longer, else it starts a new chunk
    (a chunk costs one gather and one fused attention call per layer). A chunk's
    gathered fp32 K and V stay within `GATHER_BYTES_PER_THREAD` per CPU thread, which
    the CPU caches still hold when attention reads them back. Built (and the block
    table and context lengths checked) by `decode_layout`.
    """

    chunks: tuple[_Chunk, ...]
    num_seqs: int
    block_size: int
    padded_tokens: int  # K/V tokens gathered beyond the contexts, all chunks together


def decode_layout(
    key_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    block_size: int,
) -> DecodeLayout:
    """The `DecodeLayout` of sequences with `block_table` and `context_lens` over a pool
    shaped like `key_cache`; raises `KernelInputError` for bad values (CPU tensors)."""
    check_block_size(block_size)
    if key_cache.device.type == "cpu" and len(context_lens):
        _check_attention_values(block_table, context_lens, block_size, key_cache.shape[0])
    lens = context_lens.tolist()
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    block_bytes = 2 * 4 * block_size * key_cache[0].numel()  # fp32 K and V of one block
    budget = GATHER_BYTES_PER_THREAD * torch.get_num_threads()
    groups: list[list[int]] = []
    for row in order:
        group = groups[-1] if groups else None
        if group is not None:
            longest = lens[group[0]]
            fits = (len(group) + 1) * -(-longest // block_size) * block_bytes <= budget
            close = longest <= PAD_RATIO * lens[row] or longest - lens[row] <= PAD_TOKENS
            if fits and close:
                group.append(row)
                continue
        groups.append([row])
    chunks = []
    padded = 0
    device = block_table.device
    for group in groups:
        rows = torch.tensor(group, dtype=torch.long, device=device)
        group_lens = context_lens.index_select(0, rows)
        max_len = lens[group[0]]
        num_blocks = -(-max_len // block_size)
        positions = torch.arange(num_blocks * block_size, device=device)
        # Table entries past a sequence's context may hold anything (-1, say): read block 0.
        used = positions[::block_size] < group_lens[:, None]
        blocks = torch.where(used, block_table.index_select(0, rows)[:, :num_blocks], 0)
        mask = None
        if lens[group[-1]] != max_len:  # no padding, nothing to mask
            mask = (positions[:max_len] < group_lens[:, None])[:, None, None, :]
        padded += sum(max_len - lens[i] for i in group)
        chunks.append(_Chunk(rows, blocks, mask, max_len, block_size))
    return DecodeLayout(tuple(chunks), len(lens), block_size, padded)


def paged_attention_torch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    block_size: int,
    scale: float | None = None,
    layout: DecodeLayout | None = None,
) -> torch.Tensor:
    """Reference decode attention: gather K/V through the block table, softmax in fp32.

    Vectorised over the batch in the chunks of a `DecodeLayout` (`layout`, which a
    caller attending several layers of one step builds once with `decode_layout`;
    built here when None): every chunk's blocks are gathered whole from the pool's
    block view, and torch's fused attention runs over them with the chunk's padding
    masked out; each KV head's query heads attend as one group of queries, so K/V are
    read once per KV head. Returns `[num_seqs, num_heads, head_dim]` in `query.dtype`.
    """
    _check_attention_inputs(
        query, key_cache, value_cache, block_table, context_lens, block_size, layout is None
    )
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[1]
    if num_seqs == 0:
        return torch.empty_like(query)
    if layout is None:
        layout = decode_layout(key_cache, block_table, context_lens, block_size=block_size)
    elif (layout.num_seqs, layout.block_size) != (num_seqs, block_size):
        raise KernelInputError(
            f"the layout is for {layout.num_seqs} sequences at block size {layout.block_size}, "
            f"got {num_seqs} at {block_size}"
        )
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    grouped = query.float().reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = torch.empty_like(grouped)
    for chunk in layout.chunks:
        part = _attend_blocks(grouped[chunk.rows], key_cache, value_cache, chunk, scale)
        out.index_copy_(0, chunk.rows, part)
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def _attend_blocks(
    grouped: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    chunk: _Chunk,
    scale: float,
) -> torch.Tensor:
    """Fused attention of `grouped [rows, num_kv_heads, group, head_dim]` (fp32) over the
    first `chunk.max_len` tokens of the K/V of `chunk.blocks`, those in `chunk.mask`.

    The blocks are gathered whole from the pools' block views into one buffer for K and V
    (in fp32 once converted), freed on return: with one such buffer alive at a time, glibc
    keeps reusing the same heap memory instead of handing it back to the system and
    faulting it in again on the next call (which two buffers, or one per chunk alive at
    once, make it do).
    """
    blocks, block_size = chunk.blocks, chunk.block_size
    rows, count = blocks.shape
    num_slots = key_cache.shape[0] // block_size * block_size
    row = block_size * key_cache[0].numel()
    gathered = key_cache.new_empty((2, rows * count, row))
    for cache, part in zip((key_cache, value_cache), gathered, strict=True):
        torch.index_select(cache[:num_slots].reshape(-1, row), 0, blocks.flatten(), out=part)
    shape = (2, rows, count * block_size, *key_cache.shape[1:])
    keys, values = gathered.float().view(shape)[:, :, : chunk.max_len].transpose(2, 3)
    return torch.nn.functional.scaled_dot_product_attention(
        grouped, keys, values, attn_mask=chunk.mask, scale=scale
    )


def default_tile_size(head_dim: int) -> int:
    """The Triton kernel's default token tile: independent of the block size, so the
    summation order (and hence every output bit) is the same for every block size."""
    return 64 if head_dim <= 128 else 32


if triton is not None:

    @triton.jit(do_not_specialize=["partition", "stride_bt", "stride_qs", "stride_os"])
    def _paged_attention_kernel(
        out_ptr,
        part_max_ptr,
        part_sum_ptr,
        part_acc_ptr,
        q_ptr,
        k_ptr,
        v_ptr,
        block_table_ptr,
        context_lens_ptr,
        scale,
        partition,
        stride_qs,
        stride_qh,
        stride_os,
        stride_oh,
        stride_ks,
        stride_kh,
        stride_vs,
        stride_vh,
        stride_bt,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        TILE: tl.constexpr,
        SPLIT: tl.constexpr,
    ):
        # One program per (sequence, KV head, partition); it serves the KV head's
        # GROUP query heads, so each K/V tile is loaded once for the whole group.
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        part = tl.program_id(2)
        num_parts = tl.num_programs(2)
        context_len = tl.load(context_lens_ptr + seq)
        group = tl.arange(0, GROUP_PAD)
        in_group = group < GROUP
        heads = kv_head * GROUP + group
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(
            q_ptr + seq * stride_qs + heads[:, None] * stride_qh + dims[None, :],
            mask=in_group[:, None],
            other=0.0,
        )
        run_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        run_sum = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        start = part * partition
        stop = tl.minimum(context_len, start + partition)
        for tile_start in range(start, stop, TILE):
            tokens = tile_start + tl.arange(0, TILE)
            valid = tokens < stop
            block = tl.load(
                block_table_ptr + seq * stride_bt + tokens // BLOCK_SIZE, mask=valid, other=0
            )
            slots = block.to(tl.int64) * BLOCK_SIZE + tokens % BLOCK_SIZE
            k = tl.load(
                k_ptr + slots[:, None] * stride_ks + kv_head * stride_kh + dims[None, :],
                mask=valid[:, None],
                other=0.0,
            )
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            scores = tl.where(valid[None, :], scores, float("-inf"))
            # Every tile holds at least one valid token, so new_max is finite.
            new_max = tl.maximum(run_max, tl.max(scores, axis=1))
            rescale = tl.exp(run_max - new_max)
            probs = tl.exp(scores - new_max[:, None])
            run_sum = run_sum * rescale + tl.sum(probs, axis=1)
            v = tl.load(
                v_ptr + slots[:, None] * stride_vs + kv_head * stride_vh + dims[None, :],
                mask=valid[:, None],
                other=0.0,
            )
            acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision="ieee")
            run_max = new_max
        if SPLIT:
            row = (seq * tl.num_programs(1) * GROUP + heads) * num_parts + part
            tl.store(part_max_ptr + row, run_max, mask=in_group)
            tl.store(part_sum_ptr + row, run_sum, mask=in_group)
            tl.store(
                part_acc_ptr + row[:, None] * HEAD_DIM + dims[None, :], acc, mask=in_group[:, None]
            )
        else:
            out = acc / run_sum[:, None]
            tl.store(
                out_ptr + seq * stride_os + heads[:, None] * stride_oh + dims[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=in_group[:, None],
            )

    @triton.jit(do_not_specialize=["partition", "num_parts", "stride_os"])
    def _combine_partitions_kernel(
        out_ptr,
        part_max_ptr,
        part_sum_ptr,
        part_acc_ptr,
        context_lens_ptr,
        partition,
        num_parts,
        stride_os,
        stride_oh,
        HEAD_DIM: tl.constexpr,
    ):
        # One program per (sequence, query head): merge its partitions' softmax states.
        seq = tl.program_id(0)
        head = tl.program_id(1)
        used = tl.cdiv(tl.load(context_lens_ptr + seq), partition)
        dims = tl.arange(0, HEAD_DIM)
        first = (seq * tl.num_programs(1) + head) * num_parts
        total_max = tl.load(part_max_ptr + first)
        total_sum = tl.load(part_sum_ptr + first)
        acc = tl.load(part_acc_ptr + first * HEAD_DIM + dims)
        for part in range(1, used):
            part_max = tl.load(part_max_ptr + first + part)
            new_max = tl.maximum(total_max, part_max)
            old_weight = tl.exp(total_max - new_max)
            part_weight = tl.exp(part_max - new_max)
            total_sum = total_sum * old_weight + tl.load(part_sum_ptr + first + part) * part_weight
            acc = acc * old_weight + tl.load(part_acc_ptr + (first + part) * HEAD_DIM + dims) * (
                part_weight
            )
            total_max = new_max
        tl.store(
            out_ptr + seq * stride_os + head * stride_oh + dims,
            (acc / total_sum).to(out_ptr.dtype.element_ty),
        )

else:
    _paged_attention_kernel = None
    _combine_partitions_kernel = None


def _choose_partition(
    query: torch.Tensor, num_kv_heads: int, max_tokens: int, tile: int
) -> int | None:
    """Split-K partition size, or None for one pass: split only on CUDA when the
    (sequence, KV head) programs cannot fill the device's multiprocessors."""
    if query.device.type != "cuda":
        return None
    partition = max(DEFAULT_PARTITION, tile)
    if max_tokens <= partition:
        return None
    multiprocessors = torch.cuda.get_device_properties(query.device).multi_processor_count
    if query.shape[0] * num_kv_heads >= 2 * multiprocessors:
        return None
    return partition


def paged_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    block_size: int,
    scale: float | None = None,
    tile_size: int | None = None,
    partition_size: int | None = None,
) -> torch.Tensor:
    """Triton decode attention with in-kernel address translation and online softmax.

    `tile_size` (a power of two, 16..256, default `default_tile_size(head_dim)`) is
    the number of tokens per inner step, independent of `block_size`.
    `partition_size` (a multiple of the tile) splits each context into partitions
    that run as separate programs and are merged by a second kernel (split-K);
    by default it is used only on CUDA when the batch is too small to fill the
    device. Returns `[num_seqs, num_heads, head_dim]` in `query.dtype`.
    """
    _check_attention_inputs(query, key_cache, value_cache, block_table, context_lens, block_size)
    require_triton(query.device)
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[1]
    if not is_power_of_two(head_dim) or not MIN_DOT <= head_dim <= MAX_HEAD_DIM:
        raise KernelInputError(f"head_dim must be a power of two in 16..256, got {head_dim}")
    tile = default_tile_size(head_dim) if tile_size is None else tile_size
    if not is_power_of_two(tile) or not MIN_DOT <= tile <= MAX_TILE:
        raise KernelInputError(f"tile_size must be a power of two in 16..256, got {tile}")
    if query.dtype == torch.bfloat16 and not isinstance(_paged_attention_kernel, JITFunction):
        raise KernelInputError(
            "bfloat16 needs compiled Triton: the interpreter multiplies bf16 dot operands "
            "as raw integers"
        )
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.stride(2) != 1:
            raise KernelInputError(f"{name} must be contiguous in head_dim")
    query = query.contiguous()
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    max_tokens = block_table.shape[1] * block_size
    if partition_size is None:
        partition_size = _choose_partition(query, num_kv_heads, max_tokens, tile)
    elif partition_size <= 0 or partition_size % tile:
        raise KernelInputError(
            f"partition_size must be a positive multiple of the tile size {tile}, "
            f"got {partition_size}"
        )
    num_parts = 1 if partition_size is None else triton.cdiv(max_tokens, partition_size)
    split = num_parts > 1
    if split:
        states = (num_seqs, num_heads, num_parts)
        part_max = torch.empty(states, dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty((*states, head_dim), dtype=torch.float32, device=query.device)
    else:  # one pass never touches the partition states (SPLIT is a constexpr)
        part_max = part_sum = part_acc = out
    group = num_heads // num_kv_heads
    _paged_attention_kernel[(num_seqs, num_kv_heads, num_parts)](
        out,
        part_max,
        part_sum,
        part_acc,
        query,
        key_cache,
        value_cache,
        block_table,
        context_lens,
        scale,
        partition_size if split else max_tokens,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        value_cache.stride(0),
        value_cache.stride(1),
        block_table.stride(0),
        GROUP=group,
        GROUP_PAD=max(MIN_DOT, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        TILE=tile,
        SPLIT=split,
    )
    if split:
        _combine_partitions_kernel[(num_seqs, num_heads)](
            out,
            part_max,
            part_sum,
            part_acc,
            context_lens,
            partition_size,
            num_parts,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
        )
    return out


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    block_size: int,
    scale: float | None = None,
    backend: str = "torch",
    tile_size: int | None = None,
    layout: DecodeLayout | None = None,
    check_values: bool = True,
) -> torch.Tensor:
    """Decode attention of `query [num_seqs, num_heads, head_dim]` over one layer's paged
    cache, on the `backend` ("torch", "triton" or "cpu"); `tile_size` applies to Triton
    only, `layout` (see `paged_attention_torch`) to torch only. The "cpu" backend reads
    float32 and bfloat16 caches in place (`paged_attention_cpu`) and float16 ones through
    the torch backend; `check_values` False skips its check of the context lengths and
    block ids (a caller attending every layer of a step checks them once)."""
    check_backend(backend)
    if backend == "triton":
        return paged_attention_triton(
            query,
            key_cache,
            value_cache,
            block_table,
            context_lens,
            block_size=block_size,
            scale=scale,
            tile_size=tile_size,
        )
    if backend == "cpu" and key_cache.dtype in CPU_DTYPES:
        require_cpu_kernel(query.device)
        _check_attention_inputs(
            query, key_cache, value_cache, block_table, context_lens, block_size, check_values
        )
        if key_cache.is_contiguous() and value_cache.is_contiguous():
            return paged_attention_cpu(
                query,
                key_cache,
                value_cache,
                block_table,
                context_lens,
                block_size=block_size,
                scale=scale,
            )
    return paged_attention_torch(
        query,
        key_cache,
        value_cache,
        block_table,
        context_lens,
        block_size=block_size,
        scale=scale,
        layout=layout,
    )


def require_cpu_kernel(device: torch.device | str) -> None:
    """Raise `KernelInputError` unless the "cpu" backend's C kernel can run on `device`:
    CPU tensors, and a kernel that builds and loads here (the error says why not)."""
    device = torch.device(device)
    if device.type != "cpu":
        raise KernelInputError(f"backend 'cpu' got {device.type} tensors; it runs on the CPU")
    error = cpu_kernel_error()
    if error is not None:
        raise KernelInputError(f"backend 'cpu' is unavailable here ({error}); use 'torch'")


def warmup(
    block_sizes: Iterable[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    backend: str = "triton",
) -> None:
    """Compile the Triton kernel for every block size ahead of use (one-pass and split-K
    variants, default tile), so a later block-size change never waits on a JIT compile;
    for the cpu backend, build and load its C kernel now (`KernelInputError` if it cannot).
    A no-op for the torch backend."""
    check_backend(backend)
    if backend == "cpu":
        require_cpu_kernel(device)
    if backend != "triton":
        return
    device = torch.device(device)
    tile = default_tile_size(head_dim)
    for block_size in block_sizes:
        check_block_size(block_size)
        blocks = triton.cdiv(2 * tile, block_size) + 1
        query = torch.zeros((1, num_heads, head_dim), dtype=dtype, device=device)
        cache = torch.zeros(
            (blocks * block_size, num_kv_heads, head_dim), dtype=dtype, device=device
        )
        table = torch.arange(blocks, dtype=torch.int32, device=device)[None, :]
        lens = torch.full((1,), blocks * block_size, dtype=torch.int32, device=device)
        for partition_size in (None, tile):
            paged_attention_triton(
                query,
                cache,
                cache,
                table,
                lens,
                block_size=block_size,
                partition_size=partition_size,
            )
