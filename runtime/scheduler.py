"""What each engine step computes: the waiting and running requests on the KV pool's blocks.

Every `schedule()`:

1. grows every decoding request by its last sampled token; when no block is
   free, the youngest running request is preempted (its blocks are freed and
   it is recomputed from its tokens when it is admitted again);
2. gives the step's remaining token budget (`max_num_batched_tokens` less one
   token per decode) to prefills, oldest first: the partially prefilled
   request continues, then waiting requests are admitted while the budget,
   blocks and batch rows allow. Admission reserves the blocks of the whole
   context (prompt, plus the generated tokens of a preempted request); each
   prefill computes a chunk of at most the budget left, and a request yields
   its first token in the step its last chunk runs;
3. takes the copy-on-write copies the block manager asked for.

Without `max_num_batched_tokens` the budget is unlimited: every admitted
prompt is prefilled whole in its admission step.

The result is a `ScheduledBatch`, which the model runner computes in one pass.
The scheduler owns the block manager and the block table as a pair (a
block-size swap installs a new pair, `install`) and the batch rows of the table.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch

from blocktune.runtime.block_manager import BlockManager, blocks_for
from blocktune.runtime.block_table import BlockTable
from blocktune.runtime.config import EngineConfig
from blocktune.runtime.requests import Request, RequestTooLarge
from blocktune.runtime.sampling import SamplingParams

__all__ = ["PrefillChunk", "ScheduledBatch", "Scheduler"]


@dataclass(frozen=True)
class PrefillChunk:
    """Tokens `start` to `end` of a prefilling request's context; `last` when they end it,
    so the step samples the request's next token from the chunk's last position."""

    request: Request
    start: int
    end: int
    last: bool

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ScheduledBatch:
    """One step's work: the decodes (each computes its last sampled token, whose slot is
    reserved), the prefill chunks, and the block copies to do before either."""

    decodes: list[Request]
    prefills: list[PrefillChunk]
    copies: list[tuple[int, int]]  # (src, dst) block ids at the current block size

    @property
    def empty(self) -> bool:
        """Whether the step computes no token."""
        return not self.decodes and not self.prefills

    @property
    def sampled(self) -> list[Request]:
        """The requests that get a new token: the decodes, then those whose prefill ends."""
        return self.decodes + [chunk.request for chunk in self.prefills if chunk.last]


class Scheduler:
    """The unfinished requests, their blocks and table rows, and each step's batch."""

    def __init__(self, config: EngineConfig, num_slots: int, device: torch.device | str) -> None:
        """`config` with `max_model_len` set; `num_slots` token slots in the KV pool."""
        self.config = config
        self.blocks = BlockManager(
            num_slots // config.block_size,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            align=self.align(config.block_size),
        )
        self.table = BlockTable(
            config.max_num_seqs,
            blocks_for(config.max_model_len, config.block_size),
            config.block_size,
            device,
        )
        self._free_rows = list(range(config.max_num_seqs - 1, -1, -1))
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._requests: dict[int, Request] = {}
        self.preemptions = 0
        self.prefix_hit_tokens = 0
        self.peak_blocks_used = 0  # the most blocks referenced at once during a step

    @property
    def block_size(self) -> int:
        return self.blocks.block_size

    @property
    def running(self) -> tuple[Request, ...]:
        """The admitted requests (they hold blocks and a table row), oldest first."""
        return tuple(self._running)

    @property
    def unfinished(self) -> tuple[Request, ...]:
        """Every request added and not yet removed, waiting or running."""
        return tuple(self._requests.values())

    def align(self, block_size: int) -> int:
        """Allocation alignment that keeps runs whole for a grow to the largest candidate."""
        return max(1, max(self.config.candidate_block_sizes) // block_size)

    def max_stored_tokens(self, prompt_tokens: int, params: SamplingParams) -> int:
        """The most tokens a request ever holds KV for (its last token never needs a slot)."""
        return min(prompt_tokens + params.max_tokens, self.config.max_model_len) - 1

    def check_fits(self, prompt_tokens: int, params: SamplingParams) -> None:
        """Raise `RequestTooLarge` for a request the pool could not hold even alone."""
        stored = self.max_stored_tokens(prompt_tokens, params)
        needed = blocks_for(stored, self.block_size)
        if needed > self.blocks.num_blocks:
            raise RequestTooLarge(
                f"the request can hold up to {stored} tokens ({needed} blocks of "
                f"{self.block_size}) but the pool has only {self.blocks.num_blocks} blocks"
            )

    # ------------------------------------------------------------------ requests
    def add(self, request: Request) -> None:
        """Queue a new request behind the waiting ones."""
        self._requests[request.id] = request
        self._waiting.append(request)

    def remove(self, request_id: int) -> Request | None:
        """Take a request out of its queue and free its blocks and row now; None if it is
        unknown or already removed."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        if request.row is None:  # waiting (perhaps preempted, to be recomputed)
            self._waiting.remove(request)
        else:
            self._running.remove(request)
            self._release(request)
        return request

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def install(self, blocks: BlockManager, table: BlockTable) -> None:
        """Serve on a new block manager and table from now on (a block-size swap's commit)."""
        self.blocks, self.table = blocks, table

    # ------------------------------------------------------------------ the step
    def schedule(self) -> ScheduledBatch:
        """Grow the decodes, admit and chunk prefills, and take the pending block copies."""
        decodes = self._grow([r for r in self._running if not r.prefill_left])
        budget = self.config.max_num_batched_tokens
        prefills = self._schedule_prefills(math.inf if budget is None else budget - len(decodes))
        copies = self.blocks.take_pending_copies()
        used = self.blocks.num_blocks - self.blocks.num_free_blocks
        self.peak_blocks_used = max(self.peak_blocks_used, used)
        return ScheduledBatch(decodes, prefills, copies)

    def _grow(self, candidates: list[Request]) -> list[Request]:
        """Reserve a slot for each request's pending token, preempting the youngest if needed."""
        grown: list[Request] = []
        for request in candidates:
            if request.row is None:  # preempted while making room for an older request
                continue
            while not self.blocks.append_token(request.id, request.output[-1]):
                victim = max(self._running, key=lambda r: r.id)
                self._preempt(victim)
                if victim is request:
                    break
            else:
                self.table.set_row(request.row, self.blocks.block_ids(request.id))
                grown.append(request)
        return grown

    def _schedule_prefills(self, budget: float) -> list[PrefillChunk]:
        """Prefill chunks within `budget` tokens, oldest first: the partially prefilled
        request, then admissions while the budget lasts."""
        chunks: list[PrefillChunk] = []
        for request in [r for r in self._running if r.prefill_left]:
            if budget <= 0:
                return chunks
            chunks.append(self._chunk(request, budget))
            budget -= chunks[-1].num_tokens
        while budget > 0 and self._waiting and self._free_rows:
            request = self._waiting[0]
            if self.blocks.allocate(request.id, request.tokens) is None:
                break
            self._waiting.popleft()
            request.row = self._free_rows.pop()
            self.table.set_row(request.row, self.blocks.block_ids(request.id))
            self._running.append(request)
            cached = self.blocks.num_cached_tokens(request.id)
            self.prefix_hit_tokens += cached
            request.prefill_left = len(request.tokens) - cached
            chunks.append(self._chunk(request, budget))
            budget -= chunks[-1].num_tokens
        return chunks

    @staticmethod
    def _chunk(request: Request, budget: float) -> PrefillChunk:
        """The next chunk of a request's prefill, of at most `budget` tokens, counted done."""
        start = len(request.tokens) - request.prefill_left
        size = min(request.prefill_left, budget)
        request.prefill_left -= size
        return PrefillChunk(request, start, start + size, last=not request.prefill_left)

    def _preempt(self, request: Request) -> None:
        self.preemptions += 1
        self._running.remove(request)
        self._release(request)
        self._waiting.appendleft(request)

    def _release(self, request: Request) -> None:
        self.blocks.free(request.id)
        self.table.clear_row(request.row)
        self._free_rows.append(request.row)
        request.row = None

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, int]:
        """Queue lengths, pool usage, padding, preemptions and prefix-cache hits right now."""
        used_blocks = self.blocks.num_blocks - self.blocks.num_free_blocks
        # The unused tail of each sequence's last block (shared full blocks pad nothing).
        padding = sum(-self.blocks.num_tokens(r.id) % self.block_size for r in self._running)
        return {
            "block_size": self.block_size,
            "running": len(self._running),
            "waiting": len(self._waiting),
            "blocks_total": self.blocks.num_blocks,
            "blocks_used": used_blocks,
            "blocks_free": self.blocks.num_free_blocks,
            "padding_slots": padding,
            "preemptions": self.preemptions,
            "prefix_hit_tokens": self.prefix_hit_tokens,
        }
