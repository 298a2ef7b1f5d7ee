"""How each replayed policy scores: on the policy's goal, and on the per-token cost J(B).

The goal (`GoalScores`, `goal_value`) is what the decision maximises, scored
on the replay's own runs; the hindsight oracle follows the best static size
of each interval on it. The cost J(B) below is the cost model's per-token
term, reported beside it.

The per-token cost of each policy, in the cost model's unit: seconds per generated token.

The trace is cut into decision intervals of `policy.interval` by arrival time.
For interval i with S_i generated tokens, `CostModel.costs` prices every
candidate B on the interval's requests: J_i(B) [s/token] (the prefix term
counts the interval's requests whose prefix group appeared earlier in the
trace). A policy that serves interval i at size B_i scores

    objective = (sum_i S_i * J_i(B_i) + swap pauses [s]) / sum_i S_i

so static-B has B_i = B; the adaptive policy has the size in force after its
decision at the start of interval i plus its modelled swap pauses; the oracle
takes min_B J_i(B) for every interval and swaps for free. The oracle's
objective is therefore a lower bound of every static size's and of the
adaptive policy's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from blocktune.tuner.config.policy import SloSettings
from blocktune.tuner.sim.cost_model import CostModel
from blocktune.tuner.sim.forecast import goal_higher_is_better
from blocktune.tuner.sim.simulator import Run
from blocktune.tuner.sim.workload import Workload

__all__ = [
    "OVERLOAD_SHARE",
    "GoalScores",
    "IntervalCosts",
    "goal_value",
    "overloaded",
    "within_slo",
]

OVERLOAD_SHARE = 0.1
"""Where every static size serves fewer than this share of a trace's requests within the SLO,
the server is overloaded whatever the block size: a backlog builds from the first minutes and
the SLO goodput counts only the few requests served before it, so the sizes are compared on
what each still serves, tokens/s (as the decision's overload fallback ranks them)."""


@dataclass(frozen=True)
class IntervalCosts:
    """J_i(B) for every interval i and candidate B, and the tokens S_i of each interval.

    `objective[i, j]` is J_i(`block_sizes[j]`); rows of intervals without
    requests are NaN (with zero tokens).
    """

    interval_s: float
    block_sizes: tuple[int, ...]
    tokens: np.ndarray
    objective: np.ndarray

    @classmethod
    def of(cls, workload: Workload, cost_model: CostModel) -> IntervalCosts:
        """Price every interval of `workload` at each of the policy's candidates."""
        policy = cost_model.policy
        interval_s = policy.interval.total_seconds()
        sizes = policy.candidates
        index = workload.interval_index(interval_s)
        count = int(index.max()) + 1
        repeats = workload.repeats_prefix()
        tokens = np.bincount(index, weights=workload.output_tokens, minlength=count)
        objective = np.full((count, len(sizes)), np.nan)
        bounds = np.searchsorted(index, np.arange(count + 1))
        for i in np.flatnonzero(tokens):
            rows = slice(bounds[i], bounds[i + 1])
            costs = cost_model.costs(
                workload.prompt_tokens[rows],
                workload.output_tokens[rows],
                shared_prefixes=int(repeats[rows].sum()),
            )
            objective[i] = [c.objective_s_per_token for c in costs]
        return cls(interval_s, tuple(sizes), tokens.astype(np.int64), objective)

    def _column(self, block_size: int) -> int:
        return self.block_sizes.index(block_size)

    def static(self, block_size: int) -> float:
        """The objective of serving every interval at `block_size`."""
        return self.schedule(np.full(len(self.tokens), block_size))

    def schedule(self, block_sizes: np.ndarray, pause_s: float = 0.0) -> float:
        """The objective of serving interval i at `block_sizes[i]`, plus `pause_s` of swaps."""
        served = self.tokens > 0
        columns = np.array([self._column(int(b)) for b in block_sizes[served]], dtype=np.int64)
        seconds = float((self.tokens[served] * self.objective[served, columns]).sum())
        return (seconds + pause_s) / float(self.tokens.sum())

    def best_schedule(self) -> np.ndarray:
        """The cheapest candidate of every interval (an empty one keeps the previous one's)."""
        best = np.empty(len(self.tokens), dtype=np.int64)
        first = int(np.flatnonzero(self.tokens)[0])
        current = self.block_sizes[int(np.nanargmin(self.objective[first]))]
        for i, row in enumerate(self.objective):
            if self.tokens[i] > 0:
                current = self.block_sizes[int(np.nanargmin(row))]
            best[i] = current
        return best

    def sizes_in_force(self, initial: int, switches: list[tuple[int, float, int]]) -> np.ndarray:
        """Per interval, the size after the switches made in it or before (by their time: a
        tuner may decide between interval boundaries)."""
        sizes = np.full(len(self.tokens), initial, dtype=np.int64)
        for _, when, size in switches:
            sizes[min(int(when // self.interval_s), len(sizes)) :] = size
        return sizes


def within_slo(run: Run, workload: Workload, slo: SloSettings) -> np.ndarray:
    """Per request: whether its TTFT and its TPOT (requests of 2+ tokens) met the SLO."""
    ttft = run.first_token_s - workload.arrival_s
    outputs = workload.output_tokens
    later = np.maximum(outputs - 1, 1)
    tpot = np.where(outputs > 1, (run.finish_s - run.first_token_s) / later, 0.0)
    return (ttft <= slo.ttft_p99_s) & (tpot <= slo.tpot_p99_s)


@dataclass(frozen=True)
class GoalScores:
    """The policy goal scored per decision interval (by arrival) for every static size.

    For `goal: capacity` a replay runs at the trace's own load, so the capacity
    goal is scored as SLO goodput: requests served within the SLO per second of
    the replay. For `goal: ttft_p99` it is the TTFT p99 (lower is better).
    `per_interval[i, j]` is the interval-i score of `block_sizes[j]`: requests
    within the SLO (capacity), or the interval's TTFT p99 (NaN when empty).
    """

    goal: str
    block_sizes: tuple[int, ...]
    per_interval: np.ndarray

    @classmethod
    def of(
        cls,
        goal: str,
        runs: dict[int, Run],
        workload: Workload,
        interval_s: float,
        slo: SloSettings,
    ) -> GoalScores:
        """Score each static run of `runs` (by block size) interval by interval."""
        index = workload.interval_index(interval_s)
        count = int(index.max()) + 1
        sizes = tuple(runs)
        scores = np.full((count, len(sizes)), np.nan)
        for j, size in enumerate(sizes):
            run = runs[size]
            if goal == "capacity":
                met = within_slo(run, workload, slo)
                scores[:, j] = np.bincount(index, weights=met, minlength=count)
            else:
                ttft = pd.Series(run.first_token_s - workload.arrival_s)
                scores[:, j] = ttft.groupby(index).quantile(0.99).reindex(range(count))
        return cls(goal, sizes, scores)

    def best_schedule(self, preferred: int) -> np.ndarray:
        """The best static size of every interval on the goal, ties to `preferred` (the best
        static size of the whole run: sizes interact across interval boundaries, so a tie is
        no reason to leave it); an empty interval keeps the previous one's."""
        higher = goal_higher_is_better(self.goal)
        best = np.empty(len(self.per_interval), dtype=np.int64)
        current = preferred
        column = self.block_sizes.index(preferred)
        for i, row in enumerate(self.per_interval):
            if not np.all(np.isnan(row)):
                top = np.nanmax(row) if higher else np.nanmin(row)
                if row[column] != top:
                    current = self.block_sizes[int(np.flatnonzero(row == top)[0])]
                else:
                    current = preferred
            best[i] = current
        return best


def overloaded(runs: Iterable[Run], workload: Workload, slo: SloSettings) -> bool:
    """Whether the static `runs` of a capacity goal leave no goodput to compare: one of them
    serves no request within the SLO, or every one fewer than `OVERLOAD_SHARE` of them."""
    shares = [float(within_slo(run, workload, slo).mean()) for run in runs]
    return min(shares) == 0 or max(shares) < OVERLOAD_SHARE


def goal_value(goal: str, run: Run, workload: Workload, slo: SloSettings) -> float:
    """A whole run on the goal: SLO goodput [requests/s] for capacity, else TTFT p99 [s]."""
    if goal == "capacity":
        span = run.end_s - float(workload.arrival_s[0])
        met = int(within_slo(run, workload, slo).sum())
        return met / span if span > 0 else float("nan")
    return float(np.percentile(run.first_token_s - workload.arrival_s, 99))
