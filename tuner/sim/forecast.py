"""What a user would see at each candidate block size: the recent window, served again.

The window's latest requests (their lengths and arrival process) are replayed
through the serving simulator that `blocktune replay` runs, once per candidate
block size, at the observed load and at the policy's `headroom` multiple of it.
Each run gives the serving metrics a user feels (tokens/s, TTFT and TPOT
percentiles, peak KV, preemptions). The **capacity** of a block size is the
largest multiple of the observed arrival rate at which the policy's SLO (TTFT
p99 and TPOT p99) still holds, found by bisection on a log scale within
`CAPACITY_RANGE`, and which the server sustains.

A sample of `FORECAST_REQUESTS` requests is short: at a high request rate it
spans a second or two, and a server absorbs that as one burst whatever its
block size, so its TTFT stays within the SLO at any load multiple even where
the queue would grow without bound. A load is therefore also held to what the
server sustains: its **sustained load** is the token rate it generates when
saturated (the sample repeated to fill its pool or batch `SATURATION_FILLS`
times over, all arriving at once) over the observed one (the sample's
requests per second times their mean output). The saturated run is timed between its first and third
quartile of completions, away from the first admissions and the last
stragglers, each request's tokens spread evenly over its decode. Above it the
queue grows, so no multiple above it counts as within the SLO.

Deciding needs only whether another size beats the one in force by the
policy's `min_gain`, so the capacity of the size in force is bisected to
`CAPACITY_TOLERANCE`, and every other size is first probed just above and just
below it: a size that passes above is bisected upwards, one that fails below
downwards (coarsely, `COARSE_STEPS`), and one in between is reported at the
size in force's capacity, within `min_gain` of it. Capacities are monotone in
the load multiple for this simulator (more load never serves faster), which is
what the bisection relies on.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from blocktune.tuner.config.calibration import Calibration
from blocktune.tuner.config.policy import Policy, SloSettings
from blocktune.tuner.sim.simulator import Run, simulate
from blocktune.tuner.sim.step_cost import StepCostModel
from blocktune.tuner.sim.window import WindowSnapshot
from blocktune.tuner.sim.workload import Workload

__all__ = [
    "CAPACITY_RANGE",
    "FORECAST_REQUESTS",
    "Forecast",
    "Forecaster",
    "ServingMetrics",
]

FORECAST_REQUESTS = 128
"""The window's latest requests a forecast replays (a window holds up to its capacity)."""

CAPACITY_RANGE = (1 / 4096, 64.0)
"""The multiples of the observed arrival rate a capacity search spans (its result is clamped)."""

CAPACITY_TOLERANCE = 0.01
"""Relative width at which the capacity of the size in force is considered found."""

COARSE_STEPS = 3
"""Bisection steps for a size that is clearly worse than the one in force."""

SATURATION_FILLS = 4
"""How many times over a saturation run's requests fill the pool or batch (see the module
docstring)."""


@dataclass(frozen=True)
class ServingMetrics:
    """One served run as a user sees it (seconds; KV bytes across all layers).

    TTFT runs from arrival to the first token, TPOT is the mean time between a
    request's later tokens, e2e from arrival to the last token; `tokens_per_s`
    counts generated tokens over the span from the first arrival to the last
    finish.
    """

    tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    e2e_p99_s: float
    peak_kv_bytes: int
    preemptions: int

    @classmethod
    def of(cls, run: Run, workload: Workload) -> ServingMetrics:
        """The metrics of `run`, a simulation of `workload`."""
        return cls.of_times(
            workload,
            run.first_token_s,
            run.finish_s,
            run.generated,
            peak_kv_bytes=int(run.peak_kv_bytes),
            preemptions=int(run.preemptions),
        )

    @classmethod
    def of_times(
        cls,
        workload: Workload,
        first_token_s: np.ndarray,
        finish_s: np.ndarray,
        generated: np.ndarray,
        *,
        peak_kv_bytes: int = 0,
        preemptions: int = 0,
    ) -> ServingMetrics:
        """The metrics of a served workload, simulated or live, from its per-row first-token
        and finish times and generated tokens (TPOT over requests of 2+ tokens)."""
        arrival, outputs = workload.arrival_s, workload.output_tokens
        later = outputs > 1
        tpot = (finish_s[later] - first_token_s[later]) / (outputs[later] - 1)
        span = float(np.max(finish_s)) - float(arrival[0])
        tpot_p50, tpot_p99 = np.percentile(tpot, [50, 99]) if len(tpot) else (np.nan, np.nan)
        ttft_p50, ttft_p99 = np.percentile(first_token_s - arrival, [50, 99])
        return cls(
            tokens_per_s=float(generated.sum()) / span if span > 0 else math.nan,
            ttft_p50_s=float(ttft_p50),
            ttft_p99_s=float(ttft_p99),
            tpot_p50_s=float(tpot_p50),
            tpot_p99_s=float(tpot_p99),
            e2e_p99_s=float(np.percentile(finish_s - arrival, 99)),
            peak_kv_bytes=peak_kv_bytes,
            preemptions=preemptions,
        )

    @staticmethod
    def columns(of: Callable[[Any], Any]) -> tuple:
        """`text_table` columns (title, unit, cell) of tokens/s and the TTFT and TPOT
        percentiles of the metrics `of(row)` gives (a `ServingMetrics` or alike)."""
        return (
            ("tok/s", "", lambda row: f"{of(row).tokens_per_s:.1f}"),
            ("TTFT p50", "s", lambda row: f"{of(row).ttft_p50_s:.3f}"),
            ("TTFT p99", "s", lambda row: f"{of(row).ttft_p99_s:.3f}"),
            ("TPOT p50", "ms", lambda row: f"{of(row).tpot_p50_s * 1e3:.1f}"),
            ("TPOT p99", "ms", lambda row: f"{of(row).tpot_p99_s * 1e3:.1f}"),
        )

    def meets(self, slo: SloSettings) -> bool:
        """Whether both p99 latencies are within the SLO (no TPOT counts as within)."""
        tpot_ok = math.isnan(self.tpot_p99_s) or self.tpot_p99_s <= slo.tpot_p99_s
        return self.ttft_p99_s <= slo.ttft_p99_s and tpot_ok


@dataclass(frozen=True)
class Forecast:
    """One candidate's predicted service: at the observed load, at headroom, and its capacity."""

    block_size: int
    observed: ServingMetrics
    headroom: ServingMetrics
    capacity: float

    def goal_value(self, goal: str) -> float:
        """The policy goal's value: the capacity, or TTFT p99 at the headroom load."""
        return self.capacity if goal == "capacity" else self.headroom.ttft_p99_s


def goal_higher_is_better(goal: str) -> bool:
    """Capacity is maximised; a latency is minimised."""
    return goal == "capacity"


def relative_gain(goal: str, candidate: float, reference: float) -> float:
    """How much better `candidate` is than `reference` on `goal`, as a fraction of it."""
    if not reference > 0:
        return math.inf if candidate > reference and goal_higher_is_better(goal) else 0.0
    if goal_higher_is_better(goal):
        return candidate / reference - 1
    return 1 - candidate / reference


class Forecaster:
    """Replays a window's requests through the serving simulator for each block size."""

    def __init__(self, policy: Policy, calibration: Calibration) -> None:
        self.policy = policy
        self.server = StepCostModel(policy, calibration)

    def workload_of(self, snapshot: WindowSnapshot) -> Workload | None:
        """The window's latest `FORECAST_REQUESTS` requests as a workload, arriving at their
        recorded times (less those no pool could hold), or None without two of them over a
        time span."""
        order = np.argsort(snapshot.timestamps, kind="stable")[-FORECAST_REQUESTS:]
        stamps = snapshot.timestamps[order]
        if len(stamps) < 2 or not stamps[-1] > stamps[0]:
            return None
        fits = min(self.server.capacity_slots(b) for b in self.policy.candidates)
        workload = Workload.of_lengths(
            stamps - stamps[0],
            np.maximum(snapshot.prompt_tokens[order], 1),
            np.maximum(snapshot.output_tokens[order], 1),
        ).without_longer_than(fits)
        return workload if len(workload) >= 2 else None

    def metrics(self, workload: Workload, block_size: int, load: float) -> ServingMetrics:
        """Serve `workload` at `load` times its arrival rate at a fixed `block_size`."""
        scaled = replace(workload, arrival_s=workload.arrival_s / load)
        return ServingMetrics.of(simulate(scaled, self.server, block_size), scaled)

    def sustained_load(self, workload: Workload, block_size: int) -> float:
        """The multiple of `workload`'s arrival rate that the server sustains at `block_size`:
        its generated-token rate when saturated over the observed one (see the module
        docstring)."""
        span = float(workload.arrival_s[-1] - workload.arrival_s[0])
        held = float(np.mean(workload.total_tokens))
        at_once = min(self.policy.max_num_seqs, self.server.capacity_slots(block_size) / held)
        copies = max(1, math.ceil(SATURATION_FILLS * at_once / len(workload)))
        saturated = Workload.of_lengths(
            np.zeros(copies * len(workload)),
            np.tile(workload.prompt_tokens, copies),
            np.tile(workload.output_tokens, copies),
        )
        run = simulate(saturated, self.server, block_size)
        start_s, end_s = np.quantile(run.finish_s, [0.25, 0.75])
        if not end_s > start_s:
            start_s, end_s = 0.0, run.end_s
        served = _tokens_between(run, saturated.output_tokens, start_s, end_s) / (end_s - start_s)
        offered = float(np.mean(workload.output_tokens)) * (len(workload) - 1) / span
        return served / offered

    def forecast(
        self, workload: Workload, current: int, block_sizes: tuple[int, ...]
    ) -> list[Forecast]:
        """A `Forecast` per block size; `current` (the size in force) is priced first and
        most precisely (see the module docstring)."""
        headroom, gain = self.policy.headroom, self.policy.min_gain
        runs = {
            b: (self.metrics(workload, b, 1.0), self.metrics(workload, b, headroom))
            for b in block_sizes
        }
        sustained = {b: self.sustained_load(workload, b) for b in block_sizes}
        reference = self._capacity(workload, current, runs[current], sustained[current])
        out = []
        for b in block_sizes:
            capacity = reference
            above = reference * (1 + gain)
            meets = _Meets(self, workload, b, sustained[b])
            if b != current and above <= CAPACITY_RANGE[1] and meets(above):
                capacity = self._bisect(meets, reference * (1 + gain), CAPACITY_RANGE[1])
            elif b != current and not meets(reference * (1 - gain)):
                low = max(CAPACITY_RANGE[0], reference / 8)
                capacity = self._bisect(meets, low, reference * (1 - gain), COARSE_STEPS)
            out.append(Forecast(b, runs[b][0], runs[b][1], capacity))
        return out

    def meets(self, workload: Workload, block_size: int, load: float) -> bool:
        """Whether the SLO holds at `load` times the arrival rate and the server sustains it."""
        return _Meets(self, workload, block_size, self.sustained_load(workload, block_size))(load)

    def _capacity(self, workload: Workload, b: int, known: tuple, sustained: float) -> float:
        """The capacity of `b`, bracketed from its observed and headroom runs, then bisected."""
        low_limit, high_limit = CAPACITY_RANGE
        headroom, slo = self.policy.headroom, self.policy.slo
        meets = _Meets(self, workload, b, sustained)
        if known[1].meets(slo) and headroom <= sustained:
            low, high = headroom, headroom * 4
            while high < high_limit and meets(high):
                low, high = high, high * 4
            if high >= high_limit:
                if meets(high_limit):
                    return high_limit  # served within the SLO at the top of the range
                high = high_limit
        elif known[0].meets(slo) and sustained >= 1.0:
            low, high = 1.0, headroom
        else:
            low, high = 0.25, 1.0
            while low > low_limit and not meets(low):
                low, high = low / 4, low
            low = max(low, low_limit)
        return self._bisect(meets, low, high)

    @staticmethod
    def _bisect(meets: Callable[[float], bool], low: float, high: float, steps: int = 0) -> float:
        """Bisect (geometric midpoints) between a passing `low` and a failing `high`;
        without `steps`, to `CAPACITY_TOLERANCE`. Returns the last passing multiple."""
        if not high > low:
            return min(low, high)
        if steps == 0:
            steps = max(1, math.ceil(math.log2(math.log(high / low) / CAPACITY_TOLERANCE)))
        for _ in range(steps):
            middle = math.sqrt(low * high)
            if meets(middle):
                low = middle
            else:
                high = middle
        return low


def _tokens_between(run: Run, outputs: np.ndarray, start_s: float, end_s: float) -> float:
    """Tokens `run` generated from `start_s` to `end_s`, each request's spread evenly from
    its first token to its last."""
    first, finish = run.first_token_s, run.finish_s
    overlap = np.clip(np.minimum(finish, end_s) - np.maximum(first, start_s), 0.0, None)
    duration = finish - first
    share = np.where(
        duration > 0,
        overlap / np.where(duration > 0, duration, 1.0),
        (first >= start_s) & (first <= end_s),
    )
    return float((share * outputs).sum())


@dataclass(frozen=True)
class _Meets:
    """Whether one block size meets the SLO at a load multiple and sustains it."""

    forecaster: Forecaster
    workload: Workload
    block_size: int
    sustained: float

    def __call__(self, load: float) -> bool:
        if load > self.sustained:
            return False
        metrics = self.forecaster.metrics(self.workload, self.block_size, load)
        return metrics.meets(self.forecaster.policy.slo)
