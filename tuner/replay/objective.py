"""The objective of each policy, in the cost model's unit: seconds per generated token.

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

from dataclasses import dataclass

import numpy as np

from blocktune.tuner.core.cost_model import CostModel
from blocktune.tuner.core.workload import Workload

__all__ = ["IntervalCosts"]


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
        """Per interval, the size after the switches made at its start or before."""
        sizes = np.full(len(self.tokens), initial, dtype=np.int64)
        for boundary, _, size in switches:
            sizes[min(boundary, len(sizes)) :] = size
        return sizes
