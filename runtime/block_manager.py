"""Host-side bookkeeping of a paged KV cache: which block holds which tokens.

Plain Python, no torch: free lists, refcounts, per-sequence block lists and the
prefix cache live here; the device only ever sees the block table built from
them.

Allocation policy (docs/architecture.md, "The KV pool is a flat slot array"): a
sequence's next block is the block right after its last one when that block is
free (so consecutive blocks tend to form aligned buddy runs that a later grow of
the block size keeps without a copy), otherwise the most recently freed block.
With `align=G > 1` (the engine passes the largest candidate block size over the
current one) that fallback prefers the most recently freed block whose id is
congruent to the sequence's logical block index modulo G, so runs start aligned
and stay aligned after a jump. A freed sequence returns its blocks last-to-
first, so the next sequence to allocate starts on its first block and walks the
same run again.

With prefix caching, a full block is identified by a chained key (a BLAKE2b
digest of the parent block's key and the block's token ids), computed once, when
the block fills. Blocks whose refcount drops to zero keep their key and stay
reusable ("evictable") until a fresh allocation needs them; the least recently
released one is evicted first.

Decode grows every sequence by one token a step: `append_token` does that in a
few steps when the sequence alone holds a last block with room (each sequence
keeps that room as a count) or its last block is full and a block is free, and
takes the general path of `append_tokens` otherwise (a shared tail to copy, no
free block).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from blocktune.kernels import is_power_of_two

__all__ = [
    "BlockManager",
    "BlockManagerError",
    "DuplicateSequence",
    "EmptyTokens",
    "InvalidSize",
    "UnknownSequence",
    "blocks_for",
]


class BlockManagerError(ValueError):
    """A caller mistake: the message names the bad value."""


class UnknownSequence(BlockManagerError):
    """The sequence id is not allocated."""


class DuplicateSequence(BlockManagerError):
    """The sequence id is already allocated."""


class EmptyTokens(BlockManagerError):
    """A call that needs tokens got none."""


class InvalidSize(BlockManagerError):
    """A block size or block count that cannot be used."""


CacheKey = bytes
"""A full block's identity: a 128-bit BLAKE2b digest chained over the prefix's tokens."""

ROOT_KEY: CacheKey = b""
"""The parent key of a sequence's first block."""


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks of `block_size` slots that hold the K/V of `tokens` tokens.

    The one owner of "blocks for a request of p tokens": a request admitted with p
    tokens (prompt, plus what it generated before a preemption) holds the K/V of those
    p in its admission step, so it takes `blocks_for(p, B)` blocks; the token that
    step samples needs its slot only in the next step. The engine admits with it and
    the serving simulator reserves with it."""
    return -(-tokens // block_size)


_BLAKE2B = hashlib.blake2b(digest_size=16)  # copied per digest: cheaper than a constructor call


def _digest(parent: CacheKey, data: bytes | memoryview | array) -> CacheKey:
    """The 16-byte BLAKE2b digest of `parent` followed by `data`."""
    hasher = _BLAKE2B.copy()
    hasher.update(parent)
    hasher.update(data)
    return hasher.digest()


def chain_key(parent: CacheKey, tokens: Sequence[int]) -> CacheKey:
    """The key of a full block: BLAKE2b over its parent's key and its token ids (int64).

    A cryptographic digest, so two different prefixes cannot be made to share a key
    (and with it another request's KV) the way a 64-bit hash could be collided.
    """
    return _digest(parent, array("q", tokens))


def chain_keys(parent: CacheKey, tokens: Sequence[int], block_size: int) -> list[CacheKey]:
    """The keys of the full blocks of `tokens`, chained from `parent`: `chain_key` of each
    block in turn, with the token ids converted once."""
    data = memoryview(array("q", tokens))
    keys = []
    for end in range(block_size, len(data) + 1, block_size):
        hasher = _BLAKE2B.copy()  # `_digest`, inlined: this loop runs once per prompt block
        hasher.update(parent)
        hasher.update(data[end - block_size : end])
        parent = hasher.digest()
        keys.append(parent)
    return keys


@dataclass(slots=True)
class _Sequence:
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    # Tokens the last block takes before it fills, while this sequence alone holds it
    # (0 when it is full or shared): `append_token` writes there without any other check.
    room: int = 0
    # With prefix caching: tokens of the last block while it is not full (to key it once full).
    tail_tokens: list[int] = field(default_factory=list)
    # Key of the last full block (parent of the next one).
    last_full_key: CacheKey = ROOT_KEY
    num_cached_tokens: int = 0


class _FreeBlocks:
    """Free block ids in release order, also grouped by `id % align`, all operations O(1).

    Dicts serve as ordered sets: `popitem()` gives the most recently added id.
    """

    def __init__(self, align: int) -> None:
        self.align = align
        self._all: dict[int, None] = {}
        self._by_residue: list[dict[int, None]] = [{} for _ in range(align)] if align > 1 else []

    def __eq__(self, other: object) -> bool:
        """Same blocks in the same release order."""
        return isinstance(other, _FreeBlocks) and list(self._all) == list(other._all)

    __hash__ = None  # mutable

    def __len__(self) -> int:
        return len(self._all)

    def __iter__(self) -> Iterator[int]:
        return iter(self._all)

    def add(self, block: int) -> None:
        self._all[block] = None
        if self._by_residue:
            self._by_residue[block % self.align][block] = None

    def extend(self, blocks: Iterable[int]) -> None:
        """Add many blocks, in release order (the last one comes out first)."""
        blocks = list(blocks)
        self._all.update(dict.fromkeys(blocks))
        by_residue, align = self._by_residue, self.align
        if by_residue:
            for block in blocks:
                by_residue[block % align][block] = None

    def take(self, after: int | None, residue: int) -> int | None:
        """Remove and return block `after + 1` if it is free, else the most recently freed
        block, preferring one whose id % align == residue; None when none is free."""
        free, by_residue = self._all, self._by_residue
        if after is not None and after + 1 in free:
            block = after + 1
        elif by_residue and by_residue[residue % self.align]:
            block = next(reversed(by_residue[residue % self.align]))
        elif free:
            block = next(reversed(free))
        else:
            return None
        del free[block]
        if by_residue:
            del by_residue[block % self.align][block]
        return block

    def check(self) -> None:
        if self._by_residue:
            assert sum(len(d) for d in self._by_residue) == len(self._all)
            assert all(b % self.align == r for r, d in enumerate(self._by_residue) for b in d)


class BlockManager:
    """Allocates fixed-size KV blocks to sequences: sharing, copy-on-write, a prefix cache."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = False,
        align: int = 1,
    ) -> None:
        if not is_power_of_two(align):
            raise InvalidSize(f"align must be a positive power of two, got {align!r}")
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise InvalidSize(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if not is_power_of_two(block_size):
            raise InvalidSize(f"block_size must be a positive power of two, got {block_size!r}")
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._prefix_caching = enable_prefix_caching
        self._refcount = [0] * num_blocks
        self._free = _FreeBlocks(align)
        self._free.extend(range(num_blocks - 1, -1, -1))  # block 0 comes out first
        # Released blocks that still hold a cached full block, least recently released first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cache: dict[CacheKey, int] = {}
        self._block_key: list[CacheKey | None] = [None] * num_blocks
        self._seqs: dict[object, _Sequence] = {}
        self._pending_copies: list[tuple[int, int]] = []

    @classmethod
    def from_sequences(
        cls,
        num_blocks: int,
        block_size: int,
        sequences: Mapping[object, tuple[Sequence[int], Sequence[int]]],
        *,
        enable_prefix_caching: bool = False,
        align: int = 1,
    ) -> BlockManager:
        """A manager whose sequences hold exactly the given blocks.

        `sequences` maps each sequence id to `(block_ids, token_ids)`. Refcounts
        are the references counted; every other block is free (lowest id first);
        with prefix caching, full blocks are keyed from the tokens. This is how a
        block-size swap builds the state at the new size.
        """
        manager = cls(
            num_blocks, block_size, enable_prefix_caching=enable_prefix_caching, align=align
        )
        manager._free = _FreeBlocks(align)
        for seq_id, (block_ids, token_ids) in sequences.items():
            blocks, tokens = list(block_ids), list(token_ids)
            if len(blocks) != -(-len(tokens) // block_size):
                raise BlockManagerError(
                    f"sequence {seq_id!r}: {len(blocks)} blocks for {len(tokens)} tokens "
                    f"at block size {block_size}"
                )
            seq = _Sequence(blocks=blocks, num_tokens=len(tokens))
            manager._seqs[seq_id] = seq
            for block in blocks:
                manager._refcount[block] += 1
            if enable_prefix_caching:
                keys = chain_keys(ROOT_KEY, tokens, block_size)
                manager._register(seq, 0, keys)
                seq.tail_tokens = tokens[len(keys) * block_size :]
        for seq in manager._seqs.values():
            manager._update_room(seq)
        refcount = manager._refcount
        manager._free.extend(b for b in range(num_blocks - 1, -1, -1) if refcount[b] == 0)
        return manager

    # ------------------------------------------------------------------ properties
    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def enable_prefix_caching(self) -> bool:
        return self._prefix_caching

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can use: free plus evictable cached blocks."""
        return len(self._free) + len(self._evictable)

    # ------------------------------------------------------------------ queries
    def block_ids(self, seq_id: object) -> list[int]:
        return list(self._seq(seq_id).blocks)

    def num_tokens(self, seq_id: object) -> int:
        return self._seq(seq_id).num_tokens

    def num_cached_tokens(self, seq_id: object) -> int:
        """Leading tokens of the sequence found in the prefix cache when it was allocated."""
        return self._seq(seq_id).num_cached_tokens

    def sequences(self) -> list[object]:
        return list(self._seqs)

    def refcount(self, block_id: int) -> int:
        return self._refcount[block_id]

    def cached_blocks(self) -> set[int]:
        """Blocks that hold a prefix-cache entry (referenced or evictable)."""
        return set(self._cache.values())

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write pairs (src, dst) the engine must perform before the next step."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    # ------------------------------------------------------------------ mutations
    def allocate(self, seq_id: object, token_ids: Sequence[int]) -> list[int] | None:
        """Blocks for a new sequence's tokens, or None (nothing changed) when there is no room."""
        if seq_id in self._seqs:
            raise DuplicateSequence(f"sequence {seq_id!r} is already allocated")
        tokens = list(token_ids)
        if not tokens:
            raise EmptyTokens(f"allocate({seq_id!r}) needs at least one token")
        size = self._block_size
        keys = chain_keys(ROOT_KEY, tokens, size) if self._prefix_caching else []
        # The block holding the last token is never taken from the cache: the engine
        # must compute that token to get the next token's logits.
        hits = self._cached_prefix(keys[: (len(tokens) - 1) // size])
        num_needed = blocks_for(len(tokens), size) - len(hits)
        reclaimed = sum(1 for b in hits if self._refcount[b] == 0)
        if num_needed > self.num_free_blocks - reclaimed:
            return None

        num_cached = len(hits) * size
        seq = _Sequence(num_tokens=num_cached, num_cached_tokens=num_cached)
        for block in hits:
            if self._refcount[block] == 0:
                del self._evictable[block]
            self._refcount[block] += 1
            seq.blocks.append(block)
        if hits:
            seq.last_full_key = keys[len(hits) - 1]
        self._seqs[seq_id] = seq
        self._fill(seq, tokens[num_cached:], keys[len(hits) :])
        return list(seq.blocks)

    def append_tokens(self, seq_id: object, token_ids: Sequence[int]) -> bool:
        """Grow a sequence; False (nothing changed) when the blocks it needs are not free."""
        seq = self._seq(seq_id)
        tokens = list(token_ids)
        if not tokens:
            raise EmptyTokens(f"append_tokens({seq_id!r}) needs at least one token")
        size = self._block_size
        room_in_tail = (-seq.num_tokens) % size
        num_needed = -(-max(0, len(tokens) - room_in_tail) // size)
        tail_shared = room_in_tail > 0 and self._refcount[seq.blocks[-1]] > 1
        if num_needed + tail_shared > self.num_free_blocks:
            return False
        if tail_shared:
            src = seq.blocks[-1]
            dst = self._take_block(None, len(seq.blocks) - 1)
            self._refcount[src] -= 1
            self._refcount[dst] = 1
            seq.blocks[-1] = dst
            self._pending_copies.append((src, dst))
        self._fill(seq, tokens)
        return True

    def append_token(self, seq_id: object, token_id: int) -> bool:
        """Grow a sequence by one token: `append_tokens(seq_id, [token_id])`, in a few steps
        while the sequence alone holds a last block with room (the decode step's case)."""
        seq = self._seqs.get(seq_id)
        if seq is None or not (seq.room or self._open_block(seq)):
            return self.append_tokens(seq_id, (token_id,))
        seq.room -= 1
        seq.num_tokens += 1
        if self._prefix_caching:
            seq.tail_tokens.append(token_id)
            if not seq.room:
                self._seal_tail(seq)
        return True

    def fork(self, parent_id: object, child_id: object) -> None:
        """The child shares every block of the parent (refcount + 1)."""
        parent = self._seq(parent_id)
        if child_id in self._seqs:
            raise DuplicateSequence(f"sequence {child_id!r} is already allocated")
        for block in parent.blocks:
            self._refcount[block] += 1
        child = _Sequence(
            blocks=list(parent.blocks),
            num_tokens=parent.num_tokens,
            tail_tokens=list(parent.tail_tokens),
            last_full_key=parent.last_full_key,
            num_cached_tokens=parent.num_cached_tokens,
        )
        self._seqs[child_id] = child
        self._update_room(parent)
        self._update_room(child)

    def free(self, seq_id: object) -> None:
        """Release a sequence's blocks, last to first; cached full blocks stay reusable."""
        seq = self._seq(seq_id)
        del self._seqs[seq_id]
        refcount, block_key = self._refcount, self._block_key
        for block in reversed(seq.blocks):
            refcount[block] -= 1
            if refcount[block]:
                continue
            if block_key[block] is not None:
                self._evictable[block] = None
            else:
                self._free.add(block)

    @contextmanager
    def lease(self, seq_id: object, token_ids: Sequence[int]) -> Iterator[list[int] | None]:
        """Allocate for the duration of a with-block; the sequence is freed on any exit.

        Yields the block ids, or None when there was no room (nothing to free then).
        """
        blocks = self.allocate(seq_id, token_ids)
        try:
            yield blocks
        finally:
            if blocks is not None and seq_id in self._seqs:
                self.free(seq_id)

    # ------------------------------------------------------------------ invariants
    def check(self) -> None:
        """Assert every bookkeeping invariant (docs/architecture.md, "Invariants")."""
        references = [0] * self._num_blocks
        for seq_id, seq in self._seqs.items():
            assert len(seq.blocks) == -(-seq.num_tokens // self._block_size), (
                f"sequence {seq_id!r}: {len(seq.blocks)} blocks for {seq.num_tokens} tokens"
            )
            if self._prefix_caching:
                assert len(seq.tail_tokens) == seq.num_tokens % self._block_size
            for block in seq.blocks:
                references[block] += 1
        assert references == self._refcount, "refcounts differ from block-list references"
        for seq_id, seq in self._seqs.items():
            assert seq.room == 0 or (
                self._refcount[seq.blocks[-1]] == 1
                and seq.room == -seq.num_tokens % self._block_size
            ), f"sequence {seq_id!r}: room {seq.room} in its last block is wrong"
        referenced = {b for b, count in enumerate(references) if count > 0}
        self._free.check()
        free, evictable = set(self._free), set(self._evictable)
        assert not free & referenced, f"blocks both free and owned: {sorted(free & referenced)}"
        assert not evictable & referenced, "evictable blocks are still referenced"
        assert not free & evictable, "blocks both free and evictable"
        assert len(free) + len(evictable) + len(referenced) == self._num_blocks, (
            "free + evictable + referenced != total"
        )
        for key, block in self._cache.items():
            assert self._block_key[block] == key, f"cache entry for block {block} is stale"
        keyed = {b for b, key in enumerate(self._block_key) if key is not None}
        assert keyed == set(self._cache.values()), "block keys and cache map disagree"
        assert evictable <= keyed, "an evictable block has no cache key"
        assert not free & keyed, "a free block still has a cache key"

    # ------------------------------------------------------------------ internals
    def _seq(self, seq_id: object) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequence(f"unknown sequence {seq_id!r}") from None

    def _take_block(self, after: int | None, index: int) -> int:
        """A fresh block for a sequence's logical block `index`: the block after `after` if
        free, else the most recently freed one (with `align`, preferring an id congruent to
        `index`), else the least recently released cached block (its cache entry is dropped)."""
        block = self._free.take(after, index)
        if block is None:
            block, _ = self._evictable.popitem(last=False)
            del self._cache[self._block_key[block]]
            self._block_key[block] = None
        return block

    def _cached_prefix(self, keys: list[CacheKey]) -> list[int]:
        """The cached blocks of the leading `keys`, up to the first one not cached."""
        hits = []
        for key in keys:
            block = self._cache.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def _fill(self, seq: _Sequence, tokens: list[int], keys: list[CacheKey] | None = None) -> None:
        """Write tokens after the sequence's last one, taking blocks as needed (room checked).

        With prefix caching, every block they fill is keyed; `keys` are those blocks' keys
        when the caller has them already.
        """
        size = self._block_size
        blocks = seq.blocks
        first = seq.num_tokens // size  # the block the first token goes to
        seq.num_tokens += len(tokens)
        for _ in range(len(blocks), -(-seq.num_tokens // size)):
            self._push_block(seq)
        if self._prefix_caching:
            pending = seq.tail_tokens + tokens
            if keys is None:
                keys = chain_keys(seq.last_full_key, pending, size)
            self._register(seq, first, keys)
            seq.tail_tokens = pending[len(keys) * size :]
        self._update_room(seq)

    def _push_block(self, seq: _Sequence) -> None:
        """Append a fresh block to the sequence (the caller checked that one is free)."""
        blocks = seq.blocks
        block = self._take_block(blocks[-1] if blocks else None, len(blocks))
        self._refcount[block] = 1
        blocks.append(block)

    def _open_block(self, seq: _Sequence) -> bool:
        """Whether the sequence's last block is full and a fresh one could follow it (then
        it does, and `room` is a whole block)."""
        if seq.num_tokens % self._block_size or not (self._free or self._evictable):
            return False
        self._push_block(seq)
        seq.room = self._block_size
        return True

    def _seal_tail(self, seq: _Sequence) -> None:
        """The last block just filled with the tail tokens: key it and start a new tail."""
        key = chain_key(seq.last_full_key, seq.tail_tokens)
        self._enter(seq.blocks[-1], key)
        seq.last_full_key = key
        seq.tail_tokens = []

    def _register(self, seq: _Sequence, first: int, keys: list[CacheKey]) -> None:
        """The sequence's blocks `first, first + 1, ...` just filled, with these `keys`:
        `_enter` each (inlined: this loop runs once per prompt block)."""
        cache, block_key = self._cache, self._block_key
        for block, key in zip(seq.blocks[first : first + len(keys)], keys, strict=True):
            if key not in cache and block_key[block] is None:
                cache[key] = block
                block_key[block] = key
        if keys:
            seq.last_full_key = keys[-1]

    def _enter(self, block: int, key: CacheKey) -> None:
        """Enter a full block in the prefix cache (a key or a block already there stays)."""
        if key not in self._cache and self._block_key[block] is None:
            self._cache[key] = block
            self._block_key[block] = key

    def _update_room(self, seq: _Sequence) -> None:
        """Set the room `append_token` may write into: the free slots of the last block while
        this sequence alone holds it, else 0."""
        alone = bool(seq.blocks) and self._refcount[seq.blocks[-1]] == 1
        seq.room = -seq.num_tokens % self._block_size if alone else 0
