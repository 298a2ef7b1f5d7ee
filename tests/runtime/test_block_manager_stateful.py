"""A hypothesis state machine drives the BlockManager through random operations."""

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from blocktune.runtime.block_manager import BlockManager

TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=20)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / append (one or many tokens) / fork / free / lease with a model of
    every sequence's tokens."""

    @rule(data=st.data())
    def setup_once(self, data):
        if not hasattr(self, "bm"):
            self.bm = BlockManager(
                data.draw(st.integers(1, 24)),
                data.draw(st.sampled_from([1, 2, 4, 8])),
                enable_prefix_caching=data.draw(st.booleans()),
            )
            self.tokens: dict[int, list[int]] = {}
            self.next_id = 0

    def started(self):
        return hasattr(self, "bm")

    @precondition(started)
    @rule(tokens=TOKENS)
    def allocate(self, tokens):
        before = self.bm.num_free_blocks
        blocks = self.bm.allocate(self.next_id, tokens)
        if blocks is None:
            assert self.bm.num_free_blocks == before
        else:
            assert len(blocks) == -(-len(tokens) // self.bm.block_size)
            self.tokens[self.next_id] = list(tokens)
        self.next_id += 1

    @precondition(lambda self: self.started() and self.tokens)
    @rule(data=st.data(), tokens=TOKENS)
    def append(self, data, tokens):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        before = self.bm.block_ids(seq)
        if self.bm.append_tokens(seq, tokens):
            self.tokens[seq] += tokens
            after = self.bm.block_ids(seq)
            copies = dict(self.bm.take_pending_copies())
            # Blocks are only ever added at the end, except a copied-on-write tail.
            assert after[: len(before) - 1] == before[:-1]
            if after[len(before) - 1] != before[-1]:
                assert copies == {before[-1]: after[len(before) - 1]}
        else:
            assert self.bm.block_ids(seq) == before

    @precondition(lambda self: self.started() and self.tokens)
    @rule(data=st.data(), token=st.integers(0, 3))
    def append_one(self, data, token):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        before = self.bm.block_ids(seq)
        if self.bm.append_token(seq, token):
            self.tokens[seq].append(token)
            after = self.bm.block_ids(seq)
            copies = dict(self.bm.take_pending_copies())
            # One token: the same blocks, one more, or the tail copied on write.
            if len(after) > len(before):
                assert after[:-1] == before and not copies
            elif after != before:
                assert after[:-1] == before[:-1] and copies == {before[-1]: after[-1]}
        else:
            assert self.bm.block_ids(seq) == before

    @precondition(lambda self: self.started() and self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.fork(parent, self.next_id)
        assert self.bm.block_ids(self.next_id) == self.bm.block_ids(parent)
        self.tokens[self.next_id] = list(self.tokens[parent])
        self.next_id += 1

    @precondition(lambda self: self.started() and self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(seq)
        del self.tokens[seq]

    @precondition(started)
    @rule(tokens=TOKENS, extra=TOKENS)
    def cancel_in_the_middle(self, tokens, extra):
        """A lease whose body fails half-way still returns every block."""
        before = self.bm.num_free_blocks
        try:
            with self.bm.lease(self.next_id, tokens) as blocks:
                if blocks is not None:
                    self.bm.append_tokens(self.next_id, extra)
                    raise RuntimeError("cancelled")
        except RuntimeError:
            pass
        self.next_id += 1
        self.bm.take_pending_copies()
        assert self.bm.num_free_blocks == before

    @invariant()
    def consistent(self):
        if self.started():
            self.bm.check()
            for seq, tokens in self.tokens.items():
                assert self.bm.num_tokens(seq) == len(tokens)

    def teardown(self):
        if self.started():
            for seq in list(self.tokens):
                self.bm.free(seq)
            self.bm.check()
            assert self.bm.num_free_blocks == self.bm.num_blocks


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
test_block_manager_state_machine = BlockManagerMachine.TestCase
