"""BlockManager: exact block ids, free order, refcounts, copy-on-write and the prefix cache."""

import pytest

from blocktune.runtime.block_manager import (
    BlockManager,
    BlockManagerError,
    DuplicateSequence,
    EmptyTokens,
    InvalidSize,
    UnknownSequence,
)


def test_allocation_walks_consecutive_blocks_and_free_returns_them_last_to_first():
    bm = BlockManager(8, 4)
    assert bm.allocate("a", range(10)) == [0, 1, 2]
    assert bm.allocate("b", range(5)) == [3, 4]
    assert bm.num_free_blocks == 3
    bm.free("a")
    assert bm.num_free_blocks == 6
    # Most recently freed first: a's first block, then its buddy run again.
    assert bm.allocate("c", range(4)) == [0]
    assert bm.append_tokens("c", [7])
    assert bm.block_ids("c") == [0, 1]
    assert bm.num_tokens("c") == 5
    bm.check()


def test_buddy_preference_falls_back_to_most_recently_freed():
    bm = BlockManager(6, 2)
    assert bm.allocate("a", range(2)) == [0]
    assert bm.allocate("b", range(2)) == [1]
    # a's next block would be 1 (taken by b): the most recently freed block is used instead.
    assert bm.append_tokens("a", [9])
    assert bm.block_ids("a") == [0, 2]
    bm.free("b")
    assert bm.allocate("c", range(3)) == [1, 3]
    bm.check()


def test_append_into_partial_block_uses_no_new_block():
    bm = BlockManager(4, 8)
    bm.allocate("a", range(3))
    for token in range(5):
        assert bm.append_tokens("a", [token])
    assert bm.block_ids("a") == [0]
    assert bm.append_tokens("a", [1, 2, 3])
    assert bm.block_ids("a") == [0, 1]
    assert bm.num_tokens("a") == 11


def test_no_room_returns_none_or_false_and_changes_nothing():
    bm = BlockManager(3, 4)
    assert bm.allocate("a", range(8)) == [0, 1]
    assert bm.allocate("b", range(9)) is None
    assert bm.num_free_blocks == 1
    assert bm.sequences() == ["a"]
    assert bm.append_tokens("a", range(4))
    assert not bm.append_tokens("a", [1])
    assert bm.num_tokens("a") == 12
    assert bm.num_free_blocks == 0
    bm.check()


def test_fork_shares_blocks_and_copy_on_write_on_shared_tail():
    bm = BlockManager(8, 4)
    assert bm.allocate("p", range(6)) == [0, 1]
    bm.fork("p", "q")
    assert [bm.refcount(b) for b in (0, 1)] == [2, 2]
    assert bm.append_tokens("q", [1])
    assert bm.take_pending_copies() == [(1, 2)]
    assert bm.take_pending_copies() == []
    assert bm.block_ids("q") == [0, 2]
    assert [bm.refcount(b) for b in (0, 1, 2)] == [2, 1, 1]
    # The parent owns its tail alone now: no copy.
    assert bm.append_tokens("p", [1])
    assert bm.take_pending_copies() == []
    bm.free("p")
    assert bm.refcount(0) == 1
    bm.free("q")
    assert bm.num_free_blocks == 8
    bm.check()


def test_fork_of_full_blocks_appends_into_a_new_block_without_copy():
    bm = BlockManager(8, 4)
    bm.allocate("p", range(8))
    bm.fork("p", "q")
    assert bm.append_tokens("q", [1])
    assert bm.take_pending_copies() == []
    assert bm.block_ids("q") == [0, 1, 2]


def test_copy_on_write_needs_a_free_block():
    bm = BlockManager(2, 4)
    bm.allocate("p", range(6))
    bm.fork("p", "q")
    assert not bm.append_tokens("q", [1])
    assert bm.take_pending_copies() == []
    assert bm.block_ids("q") == [0, 1]


def test_prefix_cache_hit_reuses_full_blocks():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    assert bm.allocate("a", range(10)) == [0, 1, 2]
    assert bm.allocate("b", list(range(8)) + [99]) == [0, 1, 3]
    assert bm.num_cached_tokens("b") == 8
    assert [bm.refcount(b) for b in (0, 1, 2, 3)] == [2, 2, 1, 1]
    # A different first block breaks the chain: no hit for the second block either.
    assert bm.allocate("c", [5, 1, 2, 3, 4, 5, 6, 7, 8]) == [4, 5, 6]
    assert bm.num_cached_tokens("c") == 0
    bm.check()


def test_prefix_cache_never_takes_the_block_holding_the_last_token():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    bm.allocate("a", range(8))
    assert bm.allocate("b", range(8)) == [0, 2]
    assert bm.num_cached_tokens("b") == 4


def test_released_cached_blocks_stay_reusable_then_evict_lru():
    bm = BlockManager(4, 4, enable_prefix_caching=True)
    assert bm.allocate("a", range(8)) == [0, 1]
    bm.free("a")
    assert bm.num_free_blocks == 4
    # Revived from the cache after release.
    assert bm.allocate("b", list(range(4)) + [50]) == [0, 2]
    assert bm.num_cached_tokens("b") == 4
    bm.free("b")
    # Fresh blocks come from the free list first (b's tail, then its buddy), then the least
    # recently released cached block is evicted: block 1 (released before block 0).
    assert bm.allocate("c", range(100, 112)) == [2, 3, 1]
    bm.check()
    # Block 0 is still cached; but the sequence's second block has no room.
    assert bm.allocate("d", range(5)) is None
    assert bm.allocate("e", range(4)) == [0]
    bm.check()


def test_lease_frees_on_exception_and_on_normal_exit():
    bm = BlockManager(4, 4)
    with pytest.raises(RuntimeError), bm.lease("a", range(9)) as blocks:
        assert blocks == [0, 1, 2]
        raise RuntimeError("boom")
    assert bm.num_free_blocks == 4
    with bm.lease("b", range(3)) as blocks:
        assert blocks is not None
        bm.append_tokens("b", [1, 2])
    assert bm.sequences() == []
    with bm.lease("c", range(100)) as blocks:
        assert blocks is None
    bm.check()


@pytest.mark.parametrize(
    ("num_blocks", "block_size", "needle"),
    [(0, 16, "0"), (-3, 16, "-3"), (8, 12, "12"), (8, 0, "0"), (8, 3.0, "3.0")],
)
def test_bad_sizes_are_named(num_blocks, block_size, needle):
    with pytest.raises(InvalidSize, match=needle):
        BlockManager(num_blocks, block_size)


def test_caller_mistakes_raise_value_errors_naming_the_value():
    bm = BlockManager(4, 4)
    bm.allocate("a", [1])
    with pytest.raises(DuplicateSequence, match="'a'"):
        bm.allocate("a", [1])
    with pytest.raises(UnknownSequence, match="'zz'"):
        bm.free("zz")
    with pytest.raises(UnknownSequence, match="'zz'"):
        bm.append_tokens("zz", [1])
    with pytest.raises(EmptyTokens, match="'b'"):
        bm.allocate("b", [])
    with pytest.raises(EmptyTokens):
        bm.append_tokens("a", [])
    with pytest.raises(DuplicateSequence):
        bm.fork("a", "a")
    assert issubclass(BlockManagerError, ValueError)
    bm.check()


def test_check_detects_corruption():
    bm = BlockManager(4, 4)
    bm.allocate("a", range(5))
    bm._refcount[0] = 3
    with pytest.raises(AssertionError, match="refcounts"):
        bm.check()
