"""BlockManager: exact block ids, free order, refcounts, copy-on-write and the prefix cache."""

import pytest

from blocktune.runtime.block_manager import (
    ROOT_KEY,
    BlockManager,
    BlockManagerError,
    DuplicateSequence,
    EmptyTokens,
    InvalidSize,
    UnknownSequence,
    chain_key,
    chain_keys,
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


def test_append_token_walks_the_same_blocks_as_append_tokens():
    bm = BlockManager(6, 2)
    assert bm.allocate("a", range(2)) == [0]
    assert bm.allocate("b", range(2)) == [1]
    # a's next block would be 1 (taken by b): the most recently freed block is used instead.
    assert bm.append_token("a", 9)
    assert bm.block_ids("a") == [0, 2]
    assert bm.append_token("a", 8)
    assert bm.block_ids("a") == [0, 2]
    assert bm.append_token("a", 7)
    assert bm.block_ids("a") == [0, 2, 3]
    assert bm.num_tokens("a") == 5
    bm.check()


def _grow_both_ways(one, many, ops):
    """Apply `ops` to two managers, growing by one token via append_token on `one` and via
    append_tokens on `many`; assert they agree on every answer and every block id, and
    return the answers to the appends."""
    answers = []
    for op, seq, *args in ops:
        if op == "append":
            answers.append(one.append_token(seq, args[0]))
            assert many.append_tokens(seq, [args[0]]) == answers[-1]
        else:
            assert getattr(one, op)(seq, *args) == getattr(many, op)(seq, *args)
        assert one.take_pending_copies() == many.take_pending_copies()
        for s in many.sequences():
            assert one.block_ids(s) == many.block_ids(s)
            assert one.num_tokens(s) == many.num_tokens(s)
        assert [one.refcount(b) for b in range(one.num_blocks)] == [
            many.refcount(b) for b in range(many.num_blocks)
        ]
        assert one.cached_blocks() == many.cached_blocks()
        assert one.num_free_blocks == many.num_free_blocks
        one.check()
    return answers


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("align", [1, 4])
def test_append_token_equals_append_tokens_of_one_token(prefix_caching, align):
    kwargs = {"enable_prefix_caching": prefix_caching, "align": align}
    one, many = BlockManager(9, 4, **kwargs), BlockManager(9, 4, **kwargs)
    ops = [("allocate", "p", list(range(6)))]
    ops += [("append", "p", t) for t in range(6, 9)]
    ops += [("fork", "p", "q"), ("append", "q", 50), ("append", "p", 9)]  # copy-on-write
    ops += [("allocate", "r", list(range(9)))]  # a prefix-cache hit when caching
    ops += [("append", "r", t) for t in range(9, 14)]
    ops += [("free", "q"), ("append", "p", 10), ("append", "p", 11), ("append", "p", 12)]
    ops += [("append", "p", t) for t in range(13, 30)]  # runs out of blocks
    ops += [("free", "r")] + [("append", "p", t) for t in range(30, 40)]
    answers = _grow_both_ways(one, many, ops)
    assert False in answers[:-10] and answers[-10]  # full, then room again once r is freed
    assert one.take_pending_copies() == []


def test_append_token_copies_a_shared_tail_on_write():
    bm = BlockManager(8, 4)
    assert bm.allocate("p", range(6)) == [0, 1]
    bm.fork("p", "q")
    assert bm.append_token("q", 1)
    assert bm.take_pending_copies() == [(1, 2)]
    assert bm.block_ids("q") == [0, 2]
    assert bm.append_token("p", 1)
    assert bm.take_pending_copies() == []
    assert bm.block_ids("p") == [0, 1]
    bm.check()


def test_append_token_keys_a_block_once_it_fills():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    assert bm.allocate("a", [10, 11]) == [0]
    assert bm.append_token("a", 12)
    assert bm.cached_blocks() == set()  # not full yet
    assert bm.append_token("a", 13)
    assert bm.cached_blocks() == {0}
    for token in (14, 15, 16, 17):
        assert bm.append_token("a", token)
    assert bm.block_ids("a") == [0, 1]
    assert bm.cached_blocks() == {0, 1}
    # The keys chain: a prompt with a's first eight tokens hits both blocks.
    assert bm.allocate("b", [10, 11, 12, 13, 14, 15, 16, 17, 0]) == [0, 1, 2]
    assert bm.num_cached_tokens("b") == 8
    # A different first block breaks the chain even where the second block matches.
    assert bm.allocate("c", [9, 11, 12, 13, 14, 15, 16, 17, 0]) == [3, 4, 5]
    assert bm.num_cached_tokens("c") == 0
    bm.check()


def test_chain_keys_chains_chain_key_over_whole_blocks():
    tokens = list(range(100, 111))
    first = chain_key(ROOT_KEY, tokens[:4])
    second = chain_key(first, tokens[4:8])
    assert chain_keys(ROOT_KEY, tokens, 4) == [first, second]
    assert chain_keys(ROOT_KEY, tokens[:3], 4) == []
    assert len(first) == 16 and first != chain_key(ROOT_KEY, tokens[1:5])


def test_append_token_on_an_unknown_sequence_names_it():
    bm = BlockManager(4, 4)
    with pytest.raises(UnknownSequence, match="'zz'"):
        bm.append_token("zz", 1)
