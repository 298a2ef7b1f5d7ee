"""Paged attention and cache ops: torch reference vs a dense oracle, Triton vs the reference.

On a CPU the Triton cases run under the interpreter (`TRITON_INTERPRET=1`, which
`make test` sets); without it, and without CUDA, they are skipped.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from blocktune.kernels.cache_ops import copy_blocks, warmup_cache_ops, write_kv
from blocktune.kernels.paged_attention import (
    KernelInputError,
    decode_layout,
    paged_attention,
    paged_attention_torch,
    paged_attention_triton,
    require_cpu_kernel,
    require_triton,
    warmup,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def _triton_skip_reason() -> str | None:
    try:
        require_triton(DEVICE)
    except KernelInputError as error:
        return str(error)
    return None


def _cpu_skip_reason() -> str | None:
    try:
        require_cpu_kernel(DEVICE)
    except KernelInputError as error:
        return str(error)
    return None


TRITON_SKIP = _triton_skip_reason()
CPU_SKIP = _cpu_skip_reason()
needs_triton = pytest.mark.skipif(TRITON_SKIP is not None, reason=TRITON_SKIP or "")
needs_cpu_kernel = pytest.mark.skipif(CPU_SKIP is not None, reason=CPU_SKIP or "")
BACKENDS = [
    "torch",
    pytest.param("triton", marks=needs_triton),
    pytest.param("cpu", marks=needs_cpu_kernel),
]


class Paged:
    """Contiguous per-sequence K/V and the same tokens scattered into a paged pool."""

    def __init__(self, lens, block_size, num_kv_heads, head_dim, dtype, seed, spare_blocks=3):
        tokens = torch.Generator().manual_seed(seed)
        layout = torch.Generator().manual_seed(seed + 1)
        shape = (num_kv_heads, head_dim)
        # The logical K/V depend on the seed only, not on the block size.
        self.keys = [torch.randn(n, *shape, generator=tokens).to(dtype) for n in lens]
        self.values = [torch.randn(n, *shape, generator=tokens).to(dtype) for n in lens]
        counts = [math.ceil(n / block_size) for n in lens]
        total = sum(counts) + spare_blocks
        ids = torch.randperm(total, generator=layout).to(torch.int32)  # scattered block ids
        # Unused table entries are -1: the kernels must never dereference them.
        table = torch.full((len(lens), max(counts) + 1), -1, dtype=torch.int32)
        # Slots no sequence owns (spare blocks, partial-block tails) hold garbage.
        self.key_cache = torch.randn(total * block_size, *shape, generator=layout).to(dtype)
        self.value_cache = torch.randn(total * block_size, *shape, generator=layout).to(dtype)
        taken = 0
        for seq, n in enumerate(lens):
            table[seq, : counts[seq]] = ids[taken : taken + counts[seq]]
            taken += counts[seq]
            for token in range(n):
                slot = int(table[seq, token // block_size]) * block_size + token % block_size
                self.key_cache[slot] = self.keys[seq][token]
                self.value_cache[slot] = self.values[seq][token]
        self.block_table = table
        self.context_lens = torch.tensor(lens, dtype=torch.int32)

    def to(self, device):
        for name in ("key_cache", "value_cache", "block_table", "context_lens"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    def args(self, query):
        return query, self.key_cache, self.value_cache, self.block_table, self.context_lens


def dense_attention(query, keys, values, scale):
    """Independent oracle: per sequence and head, float64 softmax over contiguous K/V."""
    num_seqs, num_heads, _ = query.shape
    group = num_heads // keys[0].shape[1]
    out = torch.empty(query.shape, dtype=torch.float64)
    for seq in range(num_seqs):
        for head in range(num_heads):
            k = keys[seq][:, head // group].double()
            v = values[seq][:, head // group].double()
            weights = torch.softmax(k @ query[seq, head].double() * scale, dim=0)
            out[seq, head] = weights @ v
    return out


def _query(num_seqs, num_heads, head_dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randn(num_seqs, num_heads, head_dim, generator=gen).to(dtype)


@pytest.mark.parametrize(
    ("block_size", "num_heads", "num_kv_heads", "dtype"),
    [
        (8, 4, 4, torch.float32),
        (16, 4, 2, torch.float32),
        (32, 8, 2, torch.float32),
        (128, 4, 1, torch.float32),
        (16, 4, 2, torch.float16),
        (64, 4, 2, torch.bfloat16),
    ],
)
def test_torch_reference_matches_dense_oracle(block_size, num_heads, num_kv_heads, dtype):
    lens = [1, block_size, block_size + 1, 3 * block_size - 5]
    paged = Paged(lens, block_size, num_kv_heads, 32, dtype, seed=block_size)
    query = _query(len(lens), num_heads, 32, dtype, seed=block_size)
    out = paged_attention_torch(*paged.args(query), block_size=block_size, scale=0.3)
    expected = dense_attention(query, paged.keys, paged.values, scale=0.3)
    assert out.dtype == dtype and out.shape == query.shape
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=0)


def test_decode_layout_pads_each_chunk_only_to_its_own_longest_context():
    """Contexts of 1000, 990, 20 and 300 tokens: the short ones are not padded to 1000.
    One layout serves several layers' caches, and gives the dense oracle's output."""
    lens = [1000, 20, 990, 300]
    paged = Paged(lens, 16, 2, 16, torch.float32, seed=9)
    layout = decode_layout(paged.key_cache, paged.block_table, paged.context_lens, block_size=16)
    assert sorted(sorted(c.rows.tolist()) for c in layout.chunks) == [[0, 2], [1], [3]]
    assert layout.padded_tokens == 10  # only 990 is padded, to 1000
    query = _query(len(lens), 4, 16, torch.float32, seed=9)
    for scale in (0.2, 0.5):  # as two layers would call it
        out = paged_attention_torch(*paged.args(query), block_size=16, scale=scale, layout=layout)
        expected = dense_attention(query, paged.keys, paged.values, scale=scale)
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)
    with pytest.raises(KernelInputError, match="layout is for 4 sequences at block size 16"):
        paged_attention_torch(*paged.args(query), block_size=8, layout=layout)
    bad = paged.context_lens.clone()
    bad[1] = 0
    with pytest.raises(KernelInputError, match=r"context_lens\[1\] = 0"):
        decode_layout(paged.key_cache, paged.block_table, bad, block_size=16)


@pytest.mark.parametrize("lens", [[7, 7, 7], [1, 9, 30, 17, 16]])
@pytest.mark.parametrize("chunk_bytes", [1, 1 << 20])
def test_torch_reference_in_chunks_and_without_padding_matches_dense_oracle(
    monkeypatch, lens, chunk_bytes
):
    """One sequence per chunk or all in one; equal lengths (no mask) or ragged; a pool
    whose slot count is not a multiple of the block size."""
    from blocktune.kernels import paged_attention as module

    monkeypatch.setattr(module, "GATHER_BYTES_PER_THREAD", chunk_bytes)
    paged = Paged(lens, 8, 2, 16, torch.float32, seed=5)
    extra = torch.full((3, 2, 16), 1e4)
    paged.key_cache = torch.cat([paged.key_cache, extra])
    paged.value_cache = torch.cat([paged.value_cache, extra])
    query = _query(len(lens), 4, 16, torch.float32, seed=5)
    out = paged_attention_torch(*paged.args(query), block_size=8, scale=0.4)
    expected = dense_attention(query, paged.keys, paged.values, scale=0.4)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)


def test_torch_reference_default_scale_is_inverse_sqrt_head_dim():
    paged = Paged([5, 20], 8, 2, 16, torch.float32, seed=3)
    query = _query(2, 2, 16, torch.float32, seed=3)
    out = paged_attention(*paged.args(query), block_size=8)
    expected = dense_attention(query, paged.keys, paged.values, scale=16**-0.5)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("block_size", "tile_size", "num_heads", "num_kv_heads", "head_dim", "dtype", "partition"),
    [
        (8, 16, 4, 4, 16, torch.float32, None),  # tile > block
        (8, 64, 4, 1, 32, torch.float32, None),  # GQA 4:1, 8 blocks per tile
        (16, 16, 2, 2, 32, torch.float32, None),  # tile == block
        (128, 16, 4, 2, 16, torch.float32, None),  # tile < block: 8 tiles per block
        (64, 32, 8, 2, 32, torch.float32, 64),  # split-K over 64-token partitions
        (32, 64, 4, 2, 64, torch.float16, None),
        (16, 32, 4, 1, 32, torch.float16, 32),
        (16, 64, 4, 2, 32, torch.bfloat16, None),
    ],
)
@needs_triton
def test_triton_matches_torch_reference(
    block_size, tile_size, num_heads, num_kv_heads, head_dim, dtype, partition
):
    if dtype == torch.bfloat16 and DEVICE.type != "cuda":
        pytest.skip("the Triton interpreter cannot multiply bf16 (kernel refuses it)")
    lens = [1, block_size - 1, 2 * block_size + 3, 150]
    paged = Paged(lens, block_size, num_kv_heads, head_dim, dtype, seed=block_size + tile_size)
    query = _query(len(lens), num_heads, head_dim, dtype, seed=tile_size)
    expected = paged_attention_torch(*paged.args(query), block_size=block_size)
    paged.to(DEVICE)
    out = paged_attention_triton(
        *paged.args(query.to(DEVICE)),
        block_size=block_size,
        tile_size=tile_size,
        partition_size=partition,
    )
    assert out.dtype == dtype and out.shape == query.shape
    torch.testing.assert_close(out.cpu(), expected, atol=TOLERANCE[dtype], rtol=0)


@needs_triton
@settings(max_examples=12, deadline=None)
@given(
    lens=st.lists(st.integers(1, 200), min_size=1, max_size=3),
    block_size=st.sampled_from([8, 16, 32, 64, 128]),
    tile_size=st.sampled_from([16, 32, 64, 128]),
    group=st.sampled_from([1, 2, 4]),
    num_kv_heads=st.sampled_from([1, 2]),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    split=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_triton_matches_reference_on_random_ragged_batches(
    lens, block_size, tile_size, group, num_kv_heads, dtype, split, seed
):
    paged = Paged(lens, block_size, num_kv_heads, 16, dtype, seed=seed)
    query = _query(len(lens), group * num_kv_heads, 16, dtype, seed=seed)
    expected = paged_attention_torch(*paged.args(query), block_size=block_size, scale=0.5)
    paged.to(DEVICE)
    out = paged_attention(
        *paged.args(query.to(DEVICE)),
        block_size=block_size,
        scale=0.5,
        backend="triton",
        tile_size=tile_size,
    )
    torch.testing.assert_close(out.cpu(), expected, atol=TOLERANCE[dtype], rtol=0)
    if split:
        parts = paged_attention_triton(
            *paged.args(query.to(DEVICE)),
            block_size=block_size,
            scale=0.5,
            tile_size=tile_size,
            partition_size=tile_size,
        )
        torch.testing.assert_close(parts.cpu(), expected, atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_outputs_are_bit_identical_for_every_block_size(backend):
    lens = [3, 70, 129]
    query = _query(3, 4, 16, torch.float32, seed=7).to(DEVICE)
    outs = []
    for block_size in (8, 16, 32, 64):
        # Same seed: the same logical K/V, laid out in blocks of a different size.
        paged = Paged(lens, block_size, 2, 16, torch.float32, seed=11).to(DEVICE)
        outs.append(paged_attention(*paged.args(query), block_size=block_size, backend=backend))
    assert all(torch.equal(out, outs[0]) for out in outs[1:])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_write_kv_writes_each_token_into_its_slot(backend, index_dtype, dtype):
    gen = torch.Generator().manual_seed(5)
    num_slots, num_kv_heads, head_dim = 24, 2, 12  # head_dim need not be a power of two
    key_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    # K and V as views into a fused projection: strided in the token dimension.
    fused = torch.randn(5, 3 * num_kv_heads, head_dim, generator=gen).to(dtype)
    key, value = fused[:, num_kv_heads : 2 * num_kv_heads], fused[:, 2 * num_kv_heads :]
    slots = torch.randperm(num_slots, generator=gen)[:5].to(index_dtype)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    for token, slot in enumerate(slots.tolist()):
        expected_k[slot] = key[token]
        expected_v[slot] = value[token]
    caches = (key_cache.to(DEVICE), value_cache.to(DEVICE))
    write_kv(*caches, key.to(DEVICE), value.to(DEVICE), slots.to(DEVICE), backend=backend)
    assert torch.equal(caches[0].cpu(), expected_k)
    assert torch.equal(caches[1].cpu(), expected_v)


@needs_cpu_kernel
def test_the_cpu_write_takes_keys_whose_heads_lie_apart_through_torch():
    """Keys whose head_dim is not contiguous (here transposed) are no run of memory for the
    C copy: the cpu backend writes them as torch does, into the right slots."""
    gen = torch.Generator().manual_seed(6)
    key_cache, value_cache = torch.zeros(16, 2, 8), torch.zeros(16, 2, 8)
    key = torch.randn(3, 8, 2, generator=gen).transpose(1, 2)
    value = torch.randn(3, 2, 8, generator=gen)
    slots = torch.tensor([9, 2, 14])
    write_kv(key_cache, value_cache, key, value, slots, backend="cpu")
    expected_k, expected_v = torch.zeros(16, 2, 8), torch.zeros(16, 2, 8)
    expected_k[slots], expected_v[slots] = key, value
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("as_tensor", [False, True])
def test_copy_blocks_copies_every_pair_in_every_layer(backend, as_tensor):
    gen = torch.Generator().manual_seed(9)
    block_size, num_blocks, num_layers = 4, 8, 3
    shape = (num_blocks * block_size, 2, 8)
    key_caches = [torch.randn(*shape, generator=gen) for _ in range(num_layers)]
    value_caches = [torch.randn(*shape, generator=gen) for _ in range(num_layers)]
    pairs = [(1, 5), (3, 0), (6, 2)]
    expected = []
    for cache in key_caches + value_caches:
        blocks = cache.clone().view(num_blocks, block_size, 2, 8)
        for src, dst in pairs:
            blocks[dst] = cache.view(num_blocks, block_size, 2, 8)[src]
        expected.append(blocks.view(shape))
    keys = [cache.to(DEVICE) for cache in key_caches]
    values = [cache.to(DEVICE) for cache in value_caches]
    arg = torch.tensor(pairs, device=DEVICE) if as_tensor else pairs
    copy_blocks(keys, values, arg, block_size=block_size, backend=backend)
    for got, want in zip(keys + values, expected, strict=True):
        assert torch.equal(got.cpu(), want)
    before = [cache.clone() for cache in keys]
    copy_blocks(keys, values, [], block_size=block_size, backend=backend)
    assert all(torch.equal(a, b) for a, b in zip(keys, before, strict=True))


@pytest.mark.parametrize("backend", BACKENDS)
def test_warmup_then_every_block_size_runs(backend):
    warmup(
        [8, 32],
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        dtype=torch.float32,
        device=DEVICE,
        backend=backend,
    )
    warmup_cache_ops(
        num_kv_heads=2, head_dim=16, dtype=torch.float32, device=DEVICE, backend=backend
    )
    for block_size in (8, 32):
        paged = Paged([40, 9], block_size, 2, 16, torch.float32, seed=block_size).to(DEVICE)
        query = _query(2, 4, 16, torch.float32, seed=1).to(DEVICE)
        out = paged_attention(*paged.args(query), block_size=block_size, backend=backend)
        expected = dense_attention(query.cpu(), paged.keys, paged.values, scale=0.25)
        torch.testing.assert_close(out.cpu().double(), expected, atol=1e-5, rtol=0)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="compilation happens on CUDA only")
def test_warmup_compiles_every_variant_ahead():
    from blocktune.kernels import paged_attention as module

    warmup(
        [8, 16, 64], num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float16, device=DEVICE
    )
    cache = module._paged_attention_kernel.device_caches[torch.cuda.current_device()][0]
    compiled = len(cache)
    for block_size, lens in ((8, [3, 700, 2000]), (16, [1]), (64, [5000, 64])):
        paged = Paged(lens, block_size, 2, 64, torch.float16, seed=2).to(DEVICE)
        query = _query(len(lens), 8, 64, torch.float16, seed=2).to(DEVICE)
        paged_attention_triton(*paged.args(query), block_size=block_size)
    assert len(cache) == compiled


def _attention_case():
    paged = Paged([5, 12], 8, 2, 16, torch.float32, seed=0)
    return paged, _query(2, 4, 16, torch.float32, seed=0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"block_size": 12}, "block_size must be a power of two, got 12"),
        ({"backend": "cuda"}, "unknown backend 'cuda'"),
        ({"query": torch.zeros(2, 3, 16)}, "num_heads 3 is not a multiple of num_kv_heads 2"),
        ({"query": torch.zeros(2, 4, 8)}, "query head_dim 8 != cache head_dim 16"),
        ({"query": torch.zeros(2, 4, 16, dtype=torch.float64)}, "query dtype must be one of"),
        ({"query": torch.zeros(3, 4, 16)}, "block_table has 2 rows for 3 sequences"),
        ({"context_lens": torch.tensor([5, 0], dtype=torch.int32)}, r"context_lens\[1\] = 0"),
        ({"context_lens": torch.tensor([5, 12])}, "context_lens must be a 1-D int32 tensor"),
        ({"context_lens": torch.tensor([25, 1], dtype=torch.int32)}, "exceeds the block table"),
        (
            {"block_table": torch.tensor([[9, 0, 1], [2, 3, 4]], dtype=torch.int32)},
            r"block_table\[0, 0\] = 9 is outside the pool.s 6 blocks of 8",
        ),
        ({"value_cache": torch.zeros(10, 2, 16)}, "differ"),
    ],
)
def test_attention_rejects_bad_inputs(change, message):
    paged, query = _attention_case()
    args = {
        "query": query,
        "key_cache": paged.key_cache,
        "value_cache": paged.value_cache,
        "block_table": paged.block_table,
        "context_lens": paged.context_lens,
        "block_size": 8,
        "backend": "torch",
    } | change
    with pytest.raises(KernelInputError, match=message):
        paged_attention(**args)


@needs_triton
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tile_size": 8}, "tile_size must be a power of two in 16..256, got 8"),
        ({"tile_size": 48}, "tile_size must be a power of two in 16..256, got 48"),
        ({"tile_size": 32, "partition_size": 48}, "multiple of the tile size 32"),
    ],
)
def test_triton_rejects_bad_tiles(kwargs, message):
    paged, query = _attention_case()
    paged.to(DEVICE)
    with pytest.raises(KernelInputError, match=message):
        paged_attention_triton(*paged.args(query.to(DEVICE)), block_size=8, **kwargs)


@needs_triton
def test_triton_rejects_head_dims_it_cannot_tile():
    paged = Paged([5], 8, 1, 24, torch.float32, seed=0).to(DEVICE)
    query = _query(1, 1, 24, torch.float32, seed=0).to(DEVICE)
    with pytest.raises(KernelInputError, match="head_dim must be a power of two in 16..256"):
        paged_attention_triton(*paged.args(query), block_size=8)


@pytest.mark.skipif(TRITON_SKIP is None, reason="Triton can run here")
def test_triton_backend_explains_why_it_cannot_run():
    paged, query = _attention_case()
    with pytest.raises(KernelInputError, match="backend 'triton'"):
        paged_attention(*paged.args(query), block_size=8, backend="triton")
    cache = torch.zeros(8, 2, 4)
    with pytest.raises(KernelInputError, match="backend 'triton'"):
        copy_blocks([cache], [cache.clone()], [(0, 1)], block_size=2, backend="triton")


def test_write_kv_rejects_bad_slots():
    cache = torch.zeros(8, 2, 4)
    token = torch.ones(2, 2, 4)
    with pytest.raises(KernelInputError, match=r"slot_mapping\[1\] = 8 is outside the pool's 8"):
        write_kv(cache, cache.clone(), token, token, torch.tensor([0, 8]))
    with pytest.raises(KernelInputError, match="more than once"):
        write_kv(cache, cache.clone(), token, token, torch.tensor([3, 3]))
    with pytest.raises(KernelInputError, match=r"slot_mapping must be int32/int64 of shape \[2\]"):
        write_kv(cache, cache.clone(), token, token, torch.tensor([0.0, 1.0]))
    with pytest.raises(KernelInputError, match=r"key must be \[num_tokens, 2, 4\]"):
        write_kv(cache, cache.clone(), torch.ones(2, 4), token, torch.tensor([0, 1]))
    with pytest.raises(KernelInputError, match="unknown backend 'numpy'"):
        write_kv(cache, cache.clone(), token, token, torch.tensor([0, 1]), backend="numpy")
    assert not cache.any()


@pytest.mark.parametrize(
    ("pairs", "message"),
    [
        ([(0, 4)], r"pairs\[0\] = \(0, 4\): block 4 is outside the pool's 4 blocks"),
        ([(0, 1), (2, 1)], "same destination block more than once"),
        ([(0, 1), (1, 2)], r"pairs\[0\] = \(0, 1\): a destination block is also a source"),
        (torch.tensor([[0.0, 1.0]]), "integer pairs"),
    ],
)
def test_copy_blocks_rejects_bad_pairs(pairs, message):
    cache = torch.arange(8 * 2 * 4, dtype=torch.float32).view(8, 2, 4)
    before = cache.clone()
    with pytest.raises(KernelInputError, match=message):
        copy_blocks([cache], [cache.clone()], pairs, block_size=2)
    assert torch.equal(cache, before)


def test_copy_blocks_rejects_mismatched_layers_and_block_sizes():
    cache = torch.zeros(8, 2, 4)
    with pytest.raises(KernelInputError, match="one value cache per key cache"):
        copy_blocks([cache, cache], [cache], [(0, 1)], block_size=2)
    with pytest.raises(KernelInputError, match="layer 1: cache"):
        copy_blocks(
            [cache, torch.zeros(16, 2, 4)], [cache, torch.zeros(16, 2, 4)], [], block_size=2
        )
    with pytest.raises(KernelInputError, match="block_size must be a power of two, got 3"):
        copy_blocks([cache], [cache], [(0, 1)], block_size=3)
    with pytest.raises(KernelInputError, match="block_size 16 does not divide the pool's 8"):
        copy_blocks([cache], [cache], [(0, 1)], block_size=16)


@needs_cpu_kernel
@pytest.mark.parametrize(
    ("block_size", "num_heads", "num_kv_heads", "head_dim", "dtype"),
    [
        (8, 4, 4, 16, torch.float32),  # no grouping, a head_dim the kernel does not specialise
        (16, 9, 3, 64, torch.float32),  # SmolLM2's heads
        (32, 8, 2, 128, torch.float32),
        (1, 4, 2, 12, torch.float32),  # one token per block
        (64, 9, 3, 64, torch.bfloat16),
        (16, 4, 2, 32, torch.float16),  # read through the torch backend
    ],
)
def test_cpu_kernel_reads_blocks_in_place_and_matches_dense_oracle(
    block_size, num_heads, num_kv_heads, head_dim, dtype
):
    """Ragged contexts, scattered blocks, -1 past each context: the oracle's output, in the
    query's dtype."""
    lens = [1, block_size, block_size + 1, 3 * block_size - 1, 200]
    paged = Paged(lens, block_size, num_kv_heads, head_dim, dtype, seed=block_size + head_dim)
    query = _query(len(lens), num_heads, head_dim, dtype, seed=head_dim)
    out = paged_attention(*paged.args(query), block_size=block_size, scale=0.3, backend="cpu")
    assert out.dtype == dtype and out.shape == query.shape
    expected = dense_attention(query, paged.keys, paged.values, scale=0.3)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=0)


@needs_cpu_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_reads_queries_where_they_lie(dtype):
    """Query rows apart in a fused query/key/value buffer, as the model hands them over:
    the same bits as from a contiguous copy, and the oracle's values."""
    paged = Paged([7, 40, 65], 16, 3, 64, dtype, seed=9)
    fused = _query(3, 15, 64, dtype, seed=9)  # 9 query heads, then 3 key and 3 value heads
    query = fused[:, :9]
    assert not query.is_contiguous()
    out = paged_attention(*paged.args(query), block_size=16, scale=0.125, backend="cpu")
    copied = paged_attention(
        *paged.args(query.contiguous()), block_size=16, scale=0.125, backend="cpu"
    )
    assert out.dtype == dtype and torch.equal(out, copied)
    expected = dense_attention(query, paged.keys, paged.values, scale=0.125)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=0)


@needs_cpu_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_kernel_gives_the_same_bits_on_any_thread_count(threads):
    paged = Paged([5, 100, 33, 64], 16, 2, 64, torch.float32, seed=4)
    query = _query(4, 6, 64, torch.float32, seed=4)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = paged_attention(*paged.args(query), block_size=16, backend="cpu")
        torch.set_num_threads(threads)
        many = paged_attention(*paged.args(query), block_size=16, backend="cpu")
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)


@needs_cpu_kernel
def test_cpu_backend_checks_values_and_falls_back_for_strided_caches():
    paged = Paged([30, 9], 8, 2, 16, torch.float32, seed=6)
    query = _query(2, 4, 16, torch.float32, seed=6)
    bad = paged.block_table.clone()
    bad[0, 1] = 10_000
    with pytest.raises(KernelInputError, match=r"block_table\[0, 1\] = 10000 is outside"):
        paged_attention(
            query, paged.key_cache, paged.value_cache, bad, paged.context_lens,
            block_size=8, backend="cpu",
        )  # fmt: skip
    # Every other head of a wider pool: not contiguous, so read through the torch path.
    wide = torch.stack((paged.key_cache, paged.key_cache), dim=2).flatten(1, 2)[:, ::2]
    assert not wide.is_contiguous()
    out = paged_attention(
        query, wide, paged.value_cache, paged.block_table, paged.context_lens,
        block_size=8, scale=0.25, backend="cpu",
    )  # fmt: skip
    expected = dense_attention(query, paged.keys, paged.values, scale=0.25)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)


def test_cpu_kernel_builds_into_its_cache_or_says_why_not(monkeypatch, tmp_path):
    from blocktune.kernels import cpu_attention, cpu_library

    monkeypatch.setenv("BLOCKTUNE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", "no-such-compiler")
    cpu_library.cpu_library.cache_clear()
    try:
        assert cpu_library.cpu_kernel_error() == "no C compiler found ($CC or cc)"
        assert cpu_attention.default_backend("cpu") == "torch"
        with pytest.raises(KernelInputError, match=r"backend 'cpu' is unavailable here .*'torch'"):
            require_cpu_kernel("cpu")
        monkeypatch.setenv("CC", "cc --no-such-flag")
        cpu_library.cpu_library.cache_clear()
        if cpu_library._compiler() is not None:
            assert "failed" in cpu_library.cpu_kernel_error()
            assert not list((tmp_path / "cache").glob("*.so"))  # nothing half-written kept
        monkeypatch.delenv("CC")
        cpu_library.cpu_library.cache_clear()
        if cpu_library.cpu_kernel_error() is None:
            assert [p.suffix for p in (tmp_path / "cache").iterdir()] == [".so"]
            assert cpu_attention.default_backend("cpu") == "cpu"
    finally:
        cpu_library.cpu_library.cache_clear()
    assert cpu_attention.default_backend("cuda") == "triton"
