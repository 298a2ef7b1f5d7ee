"""KV pool: the corrected memory formula and block-size views over the same memory."""

import os
from pathlib import Path

import pytest
import torch

from blocktune.runtime.kv_cache import KVCache, kv_bytes, slots_for_budget


def test_kv_bytes_counts_layers_and_kv_heads():
    # Llama-3-8B-like: 32 layers, 8 KV heads, head_dim 128, bf16 -> 128 KiB per token.
    assert kv_bytes(32, 8, 128, 2, 1) == 131_072
    assert kv_bytes(32, 8, 128, 2, 1000) == 131_072_000
    # A 1 GiB budget holds 8192 such token slots; aligned to 64 it still does.
    assert slots_for_budget(2**30, 32, 8, 128, 2, align=64) == 8192
    assert slots_for_budget(2**30 - 1, 32, 8, 128, 2, align=64) == 8128


def test_view_is_the_same_memory_at_every_block_size():
    cache = KVCache(num_layers=2, num_kv_heads=2, head_dim=4, num_slots=32)
    cache.k[1][9] = 1.5  # slot 9: block 1 offset 1 at B=8, block 2 offset 1 at B=4
    k8, _ = cache.view(1, 8)
    k4, v4 = cache.view(1, 4)
    assert k8.shape == (4, 8, 2, 4)
    assert torch.all(k8[1, 1] == 1.5) and torch.all(k4[2, 1] == 1.5)
    assert k4.data_ptr() == cache.k[1].data_ptr()
    assert v4.data_ptr() == cache.v[1].data_ptr()
    assert cache.num_blocks(16) == 2
    assert cache.nbytes == 2 * 2 * 32 * 2 * 4 * 4
    with pytest.raises(ValueError, match="block size 64"):
        cache.view(0, 64)


def test_from_budget_sizes_the_pool():
    cache = KVCache.from_budget(64 * 1024, 2, 2, 16, dtype=torch.float16, align=16)
    per_slot = kv_bytes(2, 2, 16, 2, 1)
    assert cache.num_slots == 64 * 1024 // per_slot // 16 * 16
    assert cache.nbytes <= 64 * 1024
    with pytest.raises(ValueError, match="holds no block"):
        KVCache.from_budget(100, 2, 2, 16, align=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_pool_starts_zeroed_in_its_dtype_with_every_tensor_its_own_memory(dtype):
    """On a CPU the pool's memory is a lazily zeroed memory map: zero, of the dtype and
    shape asked for, contiguous and writable, and no two of its tensors share a byte."""
    cache = KVCache(num_layers=2, num_kv_heads=3, head_dim=8, num_slots=40, dtype=dtype)
    tensors = [*cache.k, *cache.v]
    for tensor in tensors:
        assert tensor.dtype == dtype and tensor.shape == (40, 3, 8) and tensor.is_contiguous()
        assert torch.count_nonzero(tensor) == 0
    cache.k[0][5] = 2.0
    assert torch.count_nonzero(cache.k[0]) == 3 * 8
    assert all(torch.count_nonzero(t) == 0 for t in tensors[1:])
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))


def _resident_bytes() -> int:
    """The process's resident memory (Linux's /proc/self/statm)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux's statm")
def test_fault_in_makes_the_pool_resident_and_keeps_its_values():
    pool = KVCache(num_layers=2, num_kv_heads=2, head_dim=64, num_slots=65_536)  # 128 MiB
    pool.k[1][5] = 2.5
    pool.v[0][-1] = -0.0
    before = _resident_bytes()
    pool.fault_in()
    assert _resident_bytes() - before >= 0.9 * pool.nbytes  # the map gave pages only where written
    assert pool.k[1][5].eq(2.5).all() and pool.k[1].count_nonzero() == 128
    assert torch.signbit(pool.v[0][-1]).all() and pool.v[0].count_nonzero() == 0
