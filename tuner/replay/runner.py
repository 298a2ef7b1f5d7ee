"""Offline replay: every block-size policy served the same trace on a simulated server.

`replay(frame, policy, calibration)` plays the trace through the serving
simulator (`core.simulator`: continuous batching, a paged KV cache of the
policy's budget, the engine's batch limits and chunked prefill, preemption by
recompute, prefix reuse, step times from the calibration) once per policy:

- ``static-B`` for every candidate B of the policy;
- ``adaptive``: the real LengthWindow + Selector deciding every
  `policy.interval` of trace time (`controllers.AdaptiveController`), each
  switch charged its modelled pause (a live swap, or a vLLM restart);
- ``oracle``: in hindsight, the best static size of each interval on the
  policy's goal, swapped for free (`objective.GoalScores`). It is a reference,
  not a strict bound: sizes interact across interval boundaries.

Each policy's `PolicyResult` has the serving metrics of its run, its score on
the policy goal and its per-token cost J. Requests longer than the smallest
candidate's pool could never run and are left out; `ReplayReport.warnings`
says so, and names the runs that were overloaded.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from tqdm import tqdm

from blocktune.tuner.core.calibration import Calibration
from blocktune.tuner.core.defaults import DEFAULT_BLOCK_SIZE
from blocktune.tuner.core.forecast import ServingMetrics
from blocktune.tuner.core.policy import Policy, nearest_power_of_two
from blocktune.tuner.core.simulator import Controller, Run, simulate
from blocktune.tuner.core.step_cost import StepCostModel
from blocktune.tuner.core.workload import EmptyWorkload, Workload
from blocktune.tuner.replay.controllers import AdaptiveController, OracleController, TimelinePoint
from blocktune.tuner.replay.objective import GoalScores, IntervalCosts, goal_value

__all__ = [
    "ADAPTIVE",
    "ORACLE",
    "PolicyResult",
    "ReplayError",
    "ReplayReport",
    "replay",
    "static_name",
]

ADAPTIVE = "adaptive"
ORACLE = "oracle"


class ReplayError(ValueError):
    """A replay that cannot run as asked; the message names the bad value."""


def static_name(block_size: int) -> str:
    """The name of the static policy at `block_size`: ``static-16``."""
    return f"static-{block_size}"


@dataclass(frozen=True)
class PolicyResult:
    """One policy's metrics (seconds of trace time, bytes of K and V across all layers).

    `block_size` is None for the policies that change it. TTFT runs from arrival
    to the first token, TPOT is the mean time between a request's later tokens,
    e2e from arrival to the last token; `tokens_per_s` counts generated tokens
    over the replay's span. `goal_value` is the policy goal's score of the run
    (`objective.goal_value`), `objective` its per-token cost J. `replay_s` is the
    wall-clock time the simulation took.
    """

    policy: str
    block_size: int | None
    tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    e2e_p99_s: float
    peak_kv_bytes: int
    mean_kv_bytes: float
    padding_ratio: float
    preemptions: int
    swaps: int
    goal_value: float
    objective: float
    generated_tokens: int
    swap_pause_s: float
    replay_s: float

    @classmethod
    def of(
        cls,
        name: str,
        block_size: int | None,
        run: Run,
        workload: Workload,
        scores: tuple[float, float],
        replay_s: float,
    ) -> PolicyResult:
        """Summarise a simulated run; `scores` is (goal value, objective)."""
        metrics = ServingMetrics.of(run, workload)
        return cls(
            policy=name,
            block_size=block_size,
            tokens_per_s=metrics.tokens_per_s,
            ttft_p50_s=metrics.ttft_p50_s,
            ttft_p99_s=metrics.ttft_p99_s,
            tpot_p50_s=metrics.tpot_p50_s,
            tpot_p99_s=metrics.tpot_p99_s,
            e2e_p99_s=metrics.e2e_p99_s,
            peak_kv_bytes=metrics.peak_kv_bytes,
            mean_kv_bytes=run.kv_byte_s / run.end_s if run.end_s > 0 else 0.0,
            padding_ratio=run.padding_ratio,
            preemptions=run.preemptions,
            swaps=run.swaps,
            goal_value=scores[0],
            objective=scores[1],
            generated_tokens=int(run.generated.sum()),
            swap_pause_s=run.swap_pause_s,
            replay_s=replay_s,
        )


@dataclass(frozen=True)
class ReplayReport:
    """Every policy's result on one trace, the adaptive timeline and what the plots need.

    `oracle_schedule[i]` is the oracle's size in interval i; `runs` maps each
    policy name to its simulated `Run`.
    """

    trace: dict
    policy: dict
    results: list[PolicyResult]
    timeline: list[TimelinePoint]
    oracle_schedule: np.ndarray
    interval_s: float
    workload: Workload = field(repr=False)
    runs: dict[str, Run] = field(repr=False)
    warnings: list[str] = field(default_factory=list)

    def result(self, name: str) -> PolicyResult:
        """The result of the policy called `name` (KeyError if absent)."""
        for result in self.results:
            if result.policy == name:
                return result
        raise KeyError(name)


def replay(
    frame: pd.DataFrame,
    policy: Policy,
    calibration: Calibration,
    *,
    label: str = "trace",
    initial_block_size: int | None = None,
    fixed_step_s: float | None = None,
    progress: bool = False,
) -> ReplayReport:
    """Replay `frame` (the canonical request table) under every policy; see the module doc.

    `initial_block_size` is where the adaptive policy starts (default: the
    candidate nearest 16). `fixed_step_s` replaces the calibrated step time
    (see `StepCostModel`). `progress` shows a tqdm bar per policy.
    """
    server = StepCostModel(policy, calibration, fixed_step_s)
    initial = _initial(policy, initial_block_size)
    try:
        loaded = Workload.from_frame(frame)
    except EmptyWorkload as exc:
        raise ReplayError(f"{label}: nothing to replay: {exc}") from None
    fits = min(server.capacity_slots(b) for b in policy.candidates)
    workload = loaded.without_longer_than(fits)
    if not len(workload):
        raise ReplayError(f"{label}: every request is longer than the KV pool ({fits} token slots)")
    costs = IntervalCosts.of(workload, server.cost_model)
    results, runs = [], {}

    def play(name: str, size: int, controller: Controller | None) -> tuple[Run, float]:
        start = time.perf_counter()
        with tqdm(
            total=len(workload), desc=name, unit="req", leave=False, disable=not progress
        ) as bar:
            run = simulate(workload, server, size, controller=controller, progress=bar)
        runs[name] = run
        return run, time.perf_counter() - start

    def scores(run: Run, objective: float) -> tuple[float, float]:
        return goal_value(policy.goal, run, workload, policy.slo), objective

    static_runs = {}
    for size in policy.candidates:
        run, seconds = play(static_name(size), size, None)
        static_runs[size] = run
        result = PolicyResult.of(
            static_name(size), size, run, workload, scores(run, costs.static(size)), seconds
        )
        results.append(result)
    adaptive = AdaptiveController(
        policy, calibration, workload.prompt_tokens, workload.output_tokens, workload.group
    )
    run, seconds = play(ADAPTIVE, initial, adaptive)
    in_force = costs.sizes_in_force(initial, run.switches)
    objective = costs.schedule(in_force, run.swap_pause_s)
    results.append(PolicyResult.of(ADAPTIVE, None, run, workload, scores(run, objective), seconds))
    goal = GoalScores.of(policy.goal, static_runs, workload, costs.interval_s, policy.slo)
    schedule = goal.best_schedule()
    oracle = OracleController(costs.interval_s, schedule)
    run, seconds = play(ORACLE, int(schedule[0]), oracle)
    result = PolicyResult.of(
        ORACLE, None, run, workload, scores(run, costs.schedule(schedule)), seconds
    )
    results.append(result)
    trace = _trace_summary(label, workload, len(loaded) - len(workload))
    return ReplayReport(
        trace=trace,
        policy=_policy_summary(policy, calibration, initial),
        results=results,
        timeline=adaptive.timeline,
        oracle_schedule=schedule,
        interval_s=costs.interval_s,
        workload=workload,
        runs=runs,
        warnings=replay_warnings(trace, results, runs, workload, policy),
    )


def _initial(policy: Policy, requested: int | None) -> int:
    if requested is None:
        return nearest_power_of_two(DEFAULT_BLOCK_SIZE, policy.candidates)
    if requested not in policy.candidates:
        raise ReplayError(
            f"initial block size {requested} is not among the policy's candidates "
            f"{list(policy.candidates)}"
        )
    return requested


def _trace_summary(label: str, workload: Workload, too_long: int) -> dict:
    return {
        "label": label,
        "requests": len(workload) + too_long,
        "replayed": len(workload),
        "too_long_for_the_pool": too_long,
        "duration_s": float(workload.arrival_s[-1] - workload.arrival_s[0]),
        "prompt_tokens_median": float(np.median(workload.prompt_tokens)),
        "output_tokens_median": float(np.median(workload.output_tokens)),
        "requests_with_prefix": int(sum(g is not None for g in workload.group)),
    }


def _policy_summary(policy: Policy, calibration: Calibration, initial: int) -> dict:
    return {
        "deployment": policy.deployment,
        "kv_budget_bytes": int(policy.kv_budget),
        "candidates": list(policy.candidates),
        "interval_s": policy.interval.total_seconds(),
        "min_dwell_s": policy.min_dwell.total_seconds(),
        "window_capacity": policy.window.capacity,
        "window_min_samples": policy.window.min_samples,
        "safety_factor": policy.safety_factor,
        "goal": policy.goal,
        "slo": policy.slo.model_dump(),
        "headroom": policy.headroom,
        "min_gain": policy.min_gain,
        "engine": policy.engine,
        "initial_block_size": initial,
        "calibration": calibration.describe(),
    }


OVERLOAD_SERVED_SHARE = 0.95
"""A run that serves less than this share of the offered token rate is called overloaded."""


def replay_warnings(
    trace: dict, results: list[PolicyResult], runs: dict[str, Run], workload: Workload, policy
) -> list[str]:
    """What makes a replay's figures mean less than they seem, in words."""
    warnings = []
    span = trace["duration_s"]
    interval = policy.interval.total_seconds()
    if span < interval:
        warnings.append(
            f"the trace spans {span:.0f} s, less than one decision interval ({interval:g} s): "
            "the adaptive policy decides only once the trace's last requests run past it, so "
            "its result says little"
        )
    if trace["too_long_for_the_pool"]:
        warnings.append(
            f"{trace['too_long_for_the_pool']} of {trace['requests']} requests are longer than "
            "the smallest candidate's KV pool and were left out"
        )
    offered = float(workload.output_tokens.sum()) / span if span > 0 else math.inf
    for result in results:
        run = runs[result.policy]
        served = result.tokens_per_s
        if served < OVERLOAD_SERVED_SHARE * offered:
            backlog = run.end_s - float(workload.arrival_s[-1])
            warnings.append(
                f"{result.policy}: overloaded: offered {offered:.1f} tok/s, served "
                f"{served:.1f} tok/s; the backlog drains {backlog:.0f} s after the last "
                "arrival, so its latencies measure the queue"
            )
    return warnings
