"""A continuous-batching server with a paged KV cache, simulated by jumping between events.

The engine it models is `blocktune.runtime.engine`, and it counts blocks as the
engine does: a request generates a token in its admission step too, and holds
the K/V of p + t - 1 tokens in its t-th step (p prompt tokens; the token a step
samples gets its slot in the next step), so it is admitted with
`runtime.block_manager.blocks_for(p, B)` blocks, the owner of that count for
both. Its batch limits and prefix cache are the engine settings of the policy
(`tuner.config.engine_settings`), those the worker runs with. Every step

1. admits waiting requests, oldest first (preempted ones go back to the
   front), while the blocks they need for this step are free, after the blocks
   the running requests need for this step, and while fewer than
   `max_num_seqs` are in the batch; with the prefix cache on, each of a
   request's shareable prefix blocks (`Workload.shared_blocks`) is taken from
   it when present there (blocks are matched one by one, by their chained key);
2. prefills what is not cached (a preempted request recomputes its prompt and
   the tokens it had generated, less the leading full blocks of its own still
   cached: with the prefix cache and without a token budget the engine caches
   every full block, and a preempted request's blocks stay cached like any
   released block, its first block the most recently released). Without a
   token budget a whole prompt is computed in its admission step. With chunked
   prefill (`max_num_batched_tokens`, as vLLM schedules it) a step computes at
   most that many tokens: one per running request, the rest for prompt chunks
   of the admitted requests in admission order; a request joins the running
   ones (and makes its first token) in the step that computes its last chunk;
3. generates one token for every running request, the admitted ones included,
   taking a new block for each request whose last block is full; when the
   pool has too few, the youngest running requests are preempted (their blocks
   freed) until the rest fit;
4. frees the blocks of requests that generated their last token.

A request of p prompt and o output tokens thus spends o steps in the batch
unless preempted. Prefix blocks are reference-counted; a
block no request holds stays cached until a new block needs its slot (least
recently released first). Requests of a `Workload` must fit the pool alone.

Between events (an arrival while nothing waits, a finish, a pool overflow, a
controller's decision time) the running set is fixed, so the steps' blocks and
times follow from a few numbers: the running requests' tokens only grow, and
how many of them take a new block in a step depends only on the step's number
modulo the block size (`_Server.base_counts`). A step of a stretch thus costs a
handful of scalar operations however large the batch, and no request is
visited until the event ends the stretch.

While prompt chunks are pending, the server advances one step at a time.

A `Controller` changes the block size at interval boundaries of trace time (at
the first step boundary after each). A switch rebuilds the running requests'
blocks at the new size (preempting the youngest if they no longer fit) and, if
the controller says so, pauses the server for `StepCostModel.swap_pause_s` (a
live swap's pause for blocktune's engine, a restart for vLLM).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass
from itertools import compress
from typing import Protocol

import numpy as np

from blocktune.runtime.block_manager import blocks_for
from blocktune.tuner.config.calibration import prefill_pairs
from blocktune.tuner.config.engine_settings import engine_settings
from blocktune.tuner.sim.step_cost import StepCostModel
from blocktune.tuner.sim.workload import Workload

__all__ = ["Controller", "Run", "simulate"]

HORIZON_STEPS = 64
"""Steps priced at once while looking for the next event (a longer stretch continues)."""
SPREAD_DRAWS = 4096
"""Step-time factors drawn at a time from the calibration's step spread."""
SPREAD_HOLD_S = 0.2
"""Simulated seconds a drawn step-time factor holds for: the steps that start within that
stretch all take it, and a step longer than the hold has one of its own. A machine's slow
and fast spells last longer than a step (one engine's 150-step stretches of the same
tiny-random step, 0.3-0.7 s each, had medians from 1.9 to 4.4 ms), so factors drawn afresh
for every step average out over a request's steps and leave its TPOT p99 low. Held factors
are drawn uniformly, so a busy engine's steps see fast factors a little more often than slow
ones (a stretch of factor f holds 1/f times as many steps as one of factor 1): their mean is
1 / mean(1 / f) of the fit's, 0.94-0.99 for the spreads measured on 2026-12-07. Held so,
the p99s of three cases' kept live runs, re-simulated over eight seeds, came closer than
with factors drawn per step in all three; held factors drawn in proportion to f (which keeps
the steps' mean) put the Azure lengths' TTFT p99 32% high
(bench/results/2026-12-07-calibration-fidelity.md)."""


class Controller(Protocol):
    """Chooses the block size at interval boundaries; sees every finished request."""

    interval_s: float
    charges_swaps: bool

    def observe(self, requests: np.ndarray, finish_s: np.ndarray) -> None:
        """Requests (workload row numbers) that finished at `finish_s`, in finish order."""

    def decide(self, now: float, boundary: int, block_size: int) -> int:
        """The block size from boundary `boundary` (time `boundary * interval_s`) on."""


class Progress(Protocol):
    """Anything with tqdm's `update(n)`."""

    def update(self, n: int) -> object: ...


@dataclass(frozen=True)
class Run:
    """What one simulated policy did: per-request times and the integrated counters.

    `block_size` is the size the run started at. Times are seconds of trace
    time; `first_token_s` and `finish_s` are per workload row; slot-steps are
    token slots summed over steps; `kv_byte_s` integrates the KV bytes held over
    time. `switches` lists (boundary, time, new size). `prefix_hit_tokens` counts
    the prompt tokens admissions found in the prefix cache (not computed).
    """

    block_size: int
    first_token_s: np.ndarray
    finish_s: np.ndarray
    generated: np.ndarray
    steps: int
    preemptions: int
    swaps: int
    swap_pause_s: float
    peak_kv_bytes: int
    peak_blocks: int
    kv_byte_s: float
    allocated_slot_steps: int
    used_slot_steps: int
    busy_s: float
    switches: list[tuple[int, float, int]]
    prefix_hit_tokens: int = 0

    @property
    def end_s(self) -> float:
        return float(np.max(self.finish_s))

    @property
    def padding_ratio(self) -> float:
        """Allocated but unused share of KV slots, summed over steps."""
        return 1 - self.used_slot_steps / max(1, self.allocated_slot_steps)


def simulate(
    workload: Workload,
    server: StepCostModel,
    block_size: int,
    *,
    controller: Controller | None = None,
    progress: Progress | None = None,
    seed: int = 0,
) -> Run:
    """Replay `workload` on `server`, starting at `block_size` (fixed without a controller).
    Where the calibration has a step spread, each step's time is multiplied by a factor drawn
    from it with `seed` and held for `SPREAD_HOLD_S` of simulated time."""
    return _Server(workload, server, block_size, controller, progress, seed).run()


class _Server:
    """The state of one simulated server (see the module docstring).

    Running requests are kept in lists that do not change from step to step:
    with G the steps run so far, request j holds ``base[j] + G`` tokens and
    generates its last token in step ``last[j]``; `base_counts[r]` counts the
    running requests with ``base % B == r`` (those needing a new block in the
    steps where G + base is a multiple of B). The batch is small (tens to a few
    hundred requests) and an event changes it by one or two, so plain lists
    and a loop over the steps of a stretch cost less than numpy calls would.
    """

    def __init__(
        self,
        workload: Workload,
        server: StepCostModel,
        block_size: int,
        controller: Controller | None,
        progress: Progress | None,
        seed: int = 0,
    ) -> None:
        self.w = workload
        self.spread = server.step_spread
        self.seed = seed
        self.rng: np.random.Generator | None = None  # made at the first spread draw
        self.factors: list[float] = []  # drawn ahead
        self.factor, self.factor_until = 1.0, -math.inf  # the factor held, and until when
        self.server = server
        self.controller = controller
        self.progress = progress
        self.slot_bytes = server.kv_bytes_per_slot
        n = len(workload)
        self.arrivals: list[float] = workload.arrival_s.tolist()
        self.prompts: list[int] = workload.prompt_tokens.tolist()
        self.outputs: list[int] = workload.output_tokens.tolist()
        self.first_token: list[float] = [math.nan] * n
        self.joined: list[int] = []  # rows joined since the last step that charged a prefill
        self.finish: list[float] = [math.nan] * n
        self.generated: list[int] = [0] * n
        # Running requests, oldest admission first: row, base, last step, shared blocks.
        self.ids: list[int] = []
        self.base: list[int] = []
        self.last: list[int] = []
        self.shared: list[int] = []
        self.steps = 0  # G
        self.sum_base = 0
        self.sum_shared = 0
        self.table_blocks = 0  # sum over running requests of ceil(held / B)
        self.refs: dict[tuple[int, int], int] = {}  # prefix blocks held, with their refcounts
        self.evictable: OrderedDict[tuple, None] = OrderedDict()
        self.keys_of: dict[int, list[tuple[int, int]]] = {}
        self.waiting: deque[int] = deque()
        # (head of the queue, blocks it needs) after it did not fit; cleared when blocks free
        self.blocked: tuple[int, int] | None = None
        self.next_arrival = 0
        self.t = 0.0
        self.next_boundary = 1
        self.counters = {"preemptions": 0, "swaps": 0, "alloc": 0, "used": 0, "hits": 0}
        self.peak_bytes = self.peak_blocks = 0
        self.kv_byte_s = self.busy_s = self.pause_s = 0.0
        self.prefill_tokens = 0  # prompt tokens computed in the coming step
        self.prefill_pairs = 0  # and their attention pairs (`calibration.STEP_FORM`)
        self.prefill_chunks = 0  # and the prompts they belong to
        self.computed_counts: set[int] = set()  # token counts of the steps run so far
        engine = engine_settings(server.policy)
        self.max_seqs = engine.max_num_seqs
        self.token_budget = engine.max_num_batched_tokens
        self.prefix_caching = engine.enable_prefix_caching
        # A preempted request finds its own blocks cached again only where the engine caches
        # every full block it releases: with the prefix cache, without a token budget.
        self.caches_own_blocks = self.prefix_caching and self.token_budget is None
        # Admitted requests whose prompt chunks are still being computed (chunked prefill):
        # [row, tokens left to compute, held tokens, shared blocks]; `pending_blocks` is what
        # they reserve (their blocks for their first step, less shared prefix blocks).
        self.prefilling: deque[list[int]] = deque()
        self.pending_blocks = 0
        self.switches: list[tuple[int, float, int]] = []
        self._set_block_size(block_size)
        self.initial_block_size = block_size
        largest = int(workload.total_tokens.max())
        if blocks_for(largest - 1, block_size) > self.num_blocks:
            raise ValueError(
                f"a request of {largest} tokens does not fit the pool of {self.num_blocks} "
                f"blocks of {block_size} tokens; drop such requests before replaying"
            )

    # ---------------------------------------------------------------- main loop
    def run(self) -> Run:
        arrivals, waiting, controller = self.arrivals, self.waiting, self.controller
        total = len(arrivals)
        while True:
            arrival, t = self.next_arrival, self.t
            while arrival < total and arrivals[arrival] <= t:
                waiting.append(arrival)
                arrival += 1
            self.next_arrival = arrival
            if controller is not None:
                self._maybe_decide()
            admitted = bool(waiting) and self._admit()
            if not self.ids and not self.prefilling:
                assert not waiting, "a waiting request does not fit an empty pool"
                if arrival == total:
                    break
                self.t = max(self.t, min(arrivals[arrival], self._boundary_time()))
                continue
            if self._spare() < 0:
                self._preempt_until_fits()
                continue
            if self.prefilling:
                admitted = self._take_prompt_chunks()
                if not self.ids:
                    self._prefill_only_step()
                    continue
            self._advance(admitted)
        return Run(
            block_size=self.initial_block_size,
            first_token_s=np.array(self.first_token),
            finish_s=np.array(self.finish),
            generated=np.array(self.generated, dtype=np.int64),
            steps=self.steps,
            preemptions=self.counters["preemptions"],
            swaps=self.counters["swaps"],
            swap_pause_s=self.pause_s,
            peak_kv_bytes=self.peak_bytes,
            peak_blocks=self.peak_blocks,
            kv_byte_s=self.kv_byte_s,
            allocated_slot_steps=self.counters["alloc"],
            used_slot_steps=self.counters["used"],
            busy_s=self.busy_s,
            switches=self.switches,
            prefix_hit_tokens=self.counters["hits"],
        )

    def _boundary_time(self) -> float:
        if self.controller is None:
            return math.inf
        return self.next_boundary * self.controller.interval_s

    # ---------------------------------------------------------------- the pool
    def _set_block_size(self, block_size: int) -> None:
        self.block_size = block_size
        self.num_blocks = self.server.num_blocks(block_size)
        self.cost = self.server.step_cost(block_size)
        self.base_counts = [0] * block_size
        for base in self.base:
            self.base_counts[base % block_size] += 1
        steps = self.steps
        self.table_blocks = sum(-(-(base + steps) // block_size) for base in self.base)

    def _referenced(self) -> int:
        """Blocks held by running and prefilling requests (shared prefix blocks once)."""
        return self.table_blocks - self.sum_shared + len(self.refs) + self.pending_blocks

    def _spare(self) -> int:
        """Blocks free once the running requests take their new blocks for the next step
        (negative where those do not fit)."""
        need = self.base_counts[-self.steps % self.block_size]
        return self.num_blocks - need - self._referenced()

    def _evict_to_fit(self, spare: int) -> None:
        """Drop the least recently released cached blocks beyond `spare` blocks (the pool
        less the referenced ones, and at an admission less the running requests' blocks for
        the step too: the engine takes those before it admits anyone)."""
        spare = max(0, spare)
        while len(self.evictable) > spare:
            self.evictable.popitem(last=False)

    def _cache_own_blocks(self, request: int, shared: int, written: int) -> None:
        """Keep the full blocks of a released request's own `written` tokens (after its
        `shared` prefix blocks) cached, released last to first, as the engine's prefix cache
        does (`caches_own_blocks`: with the prefix cache, without a token budget). Only a
        preempted request finds its own again; a finished one's are there to be evicted in
        their turn."""
        if self.caches_own_blocks:
            for i in reversed(range(shared, written // self.block_size)):
                self.evictable[_own_key(request, i)] = None

    def _release(self, request: int) -> None:
        self.blocked = None
        for key in reversed(self.keys_of.pop(request, ())):
            count = self.refs[key] - 1
            if count:
                self.refs[key] = count
            else:
                del self.refs[key]
                self.evictable[key] = None

    def _remove_at(self, index: int) -> None:
        """Drop the running request at `index` (what `_remove` does for one)."""
        base, shared = self.base[index], self.shared[index]
        self.table_blocks -= -(-(base + self.steps) // self.block_size)
        self.sum_base -= base
        self.sum_shared -= shared
        self.base_counts[base % self.block_size] -= 1
        del self.ids[index], self.base[index], self.last[index], self.shared[index]

    def _remove(self, keep: list[bool]) -> None:
        """Drop the running requests whose `keep` entry is false."""
        size, steps, counts = self.block_size, self.steps, self.base_counts
        for base, shared, kept in zip(self.base, self.shared, keep, strict=True):
            if not kept:
                self.table_blocks -= -(-(base + steps) // size)
                self.sum_base -= base
                self.sum_shared -= shared
                counts[base % size] -= 1
        self.ids = list(compress(self.ids, keep))
        self.base = list(compress(self.base, keep))
        self.last = list(compress(self.last, keep))
        self.shared = list(compress(self.shared, keep))

    # ---------------------------------------------------------------- admission
    def _admit(self) -> bool:
        """Admit waiting requests that fit after the running ones' blocks for this step;
        their prefill time goes into this step. True if any was admitted."""
        size, w = self.block_size, self.w
        if self.evictable:
            self._evict_to_fit(self._spare())
        available = self._spare()
        if self.blocked and self.blocked[0] == self.waiting[0] and self.blocked[1] > available:
            return False
        joining, prefill, pairs = [], 0, 0
        room = self.max_seqs - len(self.ids) - len(self.prefilling)
        while self.waiting and room > 0:
            request = self.waiting[0]
            held = self.prompts[request] + self.generated[request]
            shareable = self.prefix_caching and request in w.chains
            shared = w.shared_blocks(request, held, size) if shareable else 0
            keys, held_hits, cached_hits = [], 0, 0
            if shared:
                keys = w.prefix_keys(request, shared, size)
                held_hits = sum(1 for k in keys if k in self.refs)
                cached_hits = sum(1 for k in keys if k in self.evictable)
            own_hits = 0
            if self.caches_own_blocks and held_hits + cached_hits == shared:
                while shared + own_hits < (held - 1) // size and (
                    _own_key(request, shared + own_hits) in self.evictable
                ):
                    own_hits += 1
            blocks = blocks_for(held, size) - held_hits
            if blocks > available:
                self.blocked = (request, blocks)
                break
            available -= blocks
            room -= 1
            self.waiting.popleft()
            for key in keys:
                if key in self.evictable:
                    del self.evictable[key]
                self.refs[key] = self.refs.get(key, 0) + 1
            if keys:
                self.keys_of[request] = keys
            if self.generated[request]:  # a preempted request's own blocks: taken or stale
                for i in range(shared, (held - 1) // size):
                    self.evictable.pop(_own_key(request, i), None)
            compute = held - (held_hits + cached_hits + own_hits) * size
            self.counters["hits"] += held - compute
            if self.token_budget is None:
                prefill += compute
                pairs += prefill_pairs(held - compute, compute)
                joining.append((request, held, shared))
            else:
                self.prefilling.append([request, compute, held, shared])
                self.pending_blocks += blocks_for(held, size) - shared
        if joining:
            self._join(joining)
            self.prefill_tokens, self.prefill_pairs = prefill, pairs
            self.prefill_chunks = len(joining)
        if self.evictable:
            self._evict_to_fit(self._spare())
        return bool(joining)

    def _join(self, joining: list[tuple[int, int, int]]) -> None:
        """Add (row, held tokens, shared blocks) to the running requests for the next step."""
        size, steps = self.block_size, self.steps
        for request, held, shared in joining:
            base = held - 1 - steps  # K/V of `held` tokens in its first step (`blocks_for`)
            self.base_counts[base % size] += 1
            self.table_blocks += blocks_for(held - 1, size)
            self.ids.append(request)
            self.joined.append(request)
            self.base.append(base)
            self.last.append(steps + self.outputs[request] - self.generated[request])
            self.shared.append(shared)
            self.sum_base += base
            self.sum_shared += shared

    def _take_prompt_chunks(self) -> bool:
        """Spend the next step's token budget: one token per running request, the rest on
        pending prompt chunks in admission order; requests whose last chunk is computed join
        the running ones. Sets the step's prefill tokens; True if any request joined."""
        budget = max(0, self.token_budget - len(self.ids))
        joining, computed, pairs, chunks = [], 0, 0, 0
        for entry in self.prefilling:
            if budget == 0:
                break
            take = min(entry[1], budget)
            chunks += take > 0
            pairs += prefill_pairs(entry[2] - entry[1], take)
            entry[1] -= take
            budget -= take
            computed += take
        while self.prefilling and self.prefilling[0][1] == 0:
            request, _, held, shared = self.prefilling.popleft()
            self.pending_blocks -= blocks_for(held, self.block_size) - shared
            joining.append((request, held, shared))
        if joining:
            self._join(joining)
        self.prefill_tokens, self.prefill_pairs, self.prefill_chunks = computed, pairs, chunks
        return bool(joining) or computed > 0

    def _prefill_only_step(self) -> None:
        """A step that computes prompt chunks while nothing decodes."""
        step_s = self.cost.fixed_s + self._prefill_s()
        if self.spread:
            step_s *= self._spread_factor(self.t)
        referenced = self._referenced()
        self._account(referenced * self.block_size, referenced, referenced * step_s, 0, step_s)
        self.t += step_s
        self.steps += 1
        self.table_blocks = 0  # nothing runs

    def _prefill_s(self) -> float:
        """The coming step's prompt work: its prompt tokens, their attention pairs, the
        prompts they belong to and, where no step before computed its number of tokens (its
        decodes and prompt tokens), the cost of a new count (`calibration.STEP_FORM`);
        the count is then one computed."""
        cost = self.cost
        count = len(self.ids) - len(self.joined) + self.prefill_tokens
        new_count = count not in self.computed_counts
        self.computed_counts.add(count)
        return (
            self.prefill_tokens * cost.prefill_s_per_token
            + self.prefill_pairs * cost.prefill_s_per_pair
            + self.prefill_chunks * cost.per_admission_s
            + new_count * cost.per_new_count_s
        )

    def _spread_factor(self, start: float) -> float:
        """The factor of a step that starts at simulated time `start`: the one held, or,
        once `SPREAD_HOLD_S` has passed since it was drawn, one of the step spread's
        quantiles drawn uniformly."""
        if start < self.factor_until:
            return self.factor
        if not self.factors:
            if self.rng is None:
                self.rng = np.random.default_rng(self.seed)
            spread = np.asarray(self.spread)
            self.factors = spread[self.rng.integers(0, len(spread), SPREAD_DRAWS)].tolist()
        self.factor, self.factor_until = self.factors.pop(), start + SPREAD_HOLD_S
        return self.factor

    def _preempt_youngest(self) -> None:
        """Free the blocks of the latest-arrived running or prefilling request and queue it
        first (a prefilling one loses its computed chunks)."""
        if self.prefilling and (not self.ids or self.prefilling[-1][0] > max(self.ids)):
            request, _, held, shared = self.prefilling.pop()
            self.pending_blocks -= blocks_for(held, self.block_size) - shared
            self._release(request)
            self.waiting.appendleft(request)
            self.counters["preemptions"] += 1
            return
        request = max(self.ids)
        index = self.ids.index(request)
        written = self.base[index] + self.steps  # K/V written; the last token sampled has none
        self.generated[request] = written + 1 - self.prompts[request]
        if request in self.joined:
            self.joined.remove(request)
        self._cache_own_blocks(request, self.shared[index], written)
        self._release(request)
        self._remove_at(index)
        self.waiting.appendleft(request)
        self.counters["preemptions"] += 1

    def _preempt_until_fits(self) -> None:
        """Preempt until every running request's block for the next step is free."""
        while self._spare() < 0:
            self._preempt_youngest()

    # ---------------------------------------------------------------- steps
    def _advance(self, admitted: bool) -> None:
        """Run the steps up to the next event; finish whoever is done.

        Within the stretch only the table blocks change (by `base_counts`), so each step's
        time is a sum of scalars: no request is visited."""
        size, cost, n, steps = self.block_size, self.cost, len(self.ids), self.steps
        first_finish = min(self.last) - steps
        horizon = 1 if self.prefilling else min(first_finish, HORIZON_STEPS)
        duplicates = self.sum_shared - len(self.refs)
        held = self.sum_base + n * steps  # tokens held before these steps
        per_block, slope = cost.per_block_s, cost.per_token_s * n
        const = cost.fixed_s + cost.per_token_s * (held + n) + cost.per_sequence_s * n
        if cost.per_padded_token_s:  # the batch padded to its longest context
            longest = max(self.base) + steps + 1
            const += cost.per_padded_token_s * n * longest
            slope += cost.per_padded_token_s * n
        stop = self._boundary_time()
        if not self.waiting and self.next_arrival < len(self.arrivals):
            stop = min(stop, self.arrivals[self.next_arrival])
        counts, limit, t, spread = self.base_counts, self.num_blocks, self.t, bool(self.spread)
        # The first step, with the admitted prompts' work (the admission left room for it).
        table_blocks = self.table_blocks + counts[-steps % size]
        referenced_sum = table_blocks - duplicates
        assert referenced_sum <= limit, "the admission check leaves room for the first step"
        step_s = per_block * table_blocks + const
        if admitted:
            step_s += self._prefill_s()
        if spread:
            step_s *= self._spread_factor(t)
        elapsed, kv_block_s = step_s, referenced_sum * step_s
        first_end = end = t + elapsed
        k = 1
        while k < horizon and end < stop:
            blocks = table_blocks + counts[(-steps - k) % size]
            referenced = blocks - duplicates
            if referenced > limit:
                break
            step_s = per_block * blocks + slope * k + const
            if spread:
                step_s *= self._spread_factor(end)
            table_blocks = blocks
            elapsed += step_s
            end = t + elapsed
            referenced_sum += referenced
            kv_block_s += referenced * step_s
            k += 1
        if k > admitted:  # decode-only steps: n tokens each
            self.computed_counts.add(n)
        unique_tokens = k * held + n * k * (k + 1) // 2 - k * duplicates * size
        self._account(
            referenced_sum * size, table_blocks - duplicates, kv_block_s, unique_tokens, end - t
        )
        if admitted:  # the joined requests still running make their first token (if not yet)
            first_token, finish = self.first_token, self.finish
            for request in self.joined:
                if math.isnan(first_token[request]) and math.isnan(finish[request]):
                    first_token[request] = first_end
            self.joined = []
        self.t = end
        self.table_blocks = table_blocks
        self.steps = steps + k
        if self.evictable:  # the stretch's new blocks came from the cache where none was free
            self._evict_to_fit(self.num_blocks - self._referenced())
        if k == first_finish:
            self._finish()

    def _finish(self) -> None:
        """Free the requests that generated their last token in the step just run."""
        steps, t, last = self.steps, self.t, self.last
        if last.count(steps) == 1:  # the common case: one request finishes
            index = last.index(steps)
            released = [(self.ids[index], self.shared[index])]
            self._remove_at(index)
        else:
            keep = [end != steps for end in last]
            released = [
                (request, shared)
                for request, shared, kept in zip(self.ids, self.shared, keep, strict=True)
                if not kept
            ]
            self._remove(keep)
        for request, shared in released:
            self.finish[request] = t
            self.generated[request] = self.outputs[request]
            # With nothing cached, blocks released now are older than all that will be, and
            # free blocks are taken first as the oldest cached ones would be: no need to key them.
            if self.evictable:
                written = self.prompts[request] + self.outputs[request] - 1
                self._cache_own_blocks(request, shared, written)
            self._release(request)
        finished = [request for request, _ in released]
        if self.controller is not None:
            rows = np.array(finished, dtype=np.int64)
            self.controller.observe(rows, np.full(len(finished), t))
        if self.progress is not None:
            self.progress.update(len(finished))

    def _account(
        self, allocated: int, peak: int, kv_block_s: float, unique_tokens: int, busy_s: float
    ) -> None:
        """Add a stretch of steps to the counters: the token slots allocated over its steps,
        the blocks referenced at its end, blocks times seconds, the tokens held and its time."""
        counters = self.counters
        counters["alloc"] += allocated
        counters["used"] += unique_tokens
        self.peak_blocks = max(self.peak_blocks, peak)
        self.peak_bytes = max(self.peak_bytes, peak * self.block_size * self.slot_bytes)
        self.kv_byte_s += kv_block_s * self.block_size * self.slot_bytes
        self.busy_s += busy_s

    # ---------------------------------------------------------------- block-size changes
    def _maybe_decide(self) -> None:
        controller = self.controller
        if self.t < self._boundary_time():
            return
        boundary = max(self.next_boundary, int(self.t // controller.interval_s))
        self.next_boundary = boundary + 1
        new_size = controller.decide(self.t, boundary, self.block_size)
        if new_size != self.block_size:
            self._swap(boundary, new_size)

    def _swap(self, boundary: int, new_size: int) -> None:
        """Rebuild the running requests' blocks at `new_size`; pause for the copy."""
        old_size = self.block_size
        # The simulated allocator keeps each request's blocks in aligned runs, as the engine's
        # does, so the plan of a grow (and of a shrink) moves no bytes: only the pause counts.
        pause = self.server.swap_pause_s() if self.controller.charges_swaps else 0.0
        held_bytes = self._referenced() * old_size * self.slot_bytes
        while self.prefilling:  # their chunks are recomputed at the new size
            request, _, held, shared = self.prefilling.pop()
            self.pending_blocks -= blocks_for(held, old_size) - shared
            self._release(request)
            self.waiting.appendleft(request)
        self._set_block_size(new_size)
        self.shared = [shared * old_size // new_size for shared in self.shared]
        self.refs, self.evictable, self.keys_of = {}, OrderedDict(), {}
        self.blocked = None
        for request, shared in zip(self.ids, self.shared, strict=True):
            if shared:
                keys = self.w.prefix_keys(request, shared, new_size)
                self.keys_of[request] = keys
                for key in keys:
                    self.refs[key] = self.refs.get(key, 0) + 1
        self.sum_shared = sum(self.shared)
        while self._referenced() > self.num_blocks:
            self._preempt_youngest()
        self.kv_byte_s += held_bytes * pause
        self.t += pause
        self.pause_s += pause
        self.counters["swaps"] += 1
        self.switches.append((boundary, self.t, new_size))


def _own_key(request: int, index: int) -> tuple[str, int, int]:
    """The prefix-cache key of block `index` of a preempted request's own tokens (distinct
    from every shared prefix block's key)."""
    return ("own", request, index)
