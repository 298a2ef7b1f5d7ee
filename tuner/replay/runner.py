"""Offline replay: every block-size policy served the same trace on a simulated server.

`replay(frame, policy, calibration)` plays the trace through the serving
simulator (`sim.simulator`: continuous batching, a paged KV cache of the
policy's budget, the engine's batch limits and chunked prefill, preemption by
recompute, prefix reuse, step times from the calibration) once per policy:

- ``static-B`` for every candidate B of the policy;
- ``adaptive``: the real LengthWindow + Selector deciding every
  `policy.interval` of trace time (`controllers.AdaptiveController`), each
  switch charged its modelled pause (a live swap, or a vLLM restart);
- ``oracle``: in hindsight, the best static size of each interval on the
  policy's goal (the quantity the goal counts per interval: requests served
  within the SLO, or the interval's TTFT p99; ties to the best static size of
  the whole run), swapped for free (`objective.GoalScores`). Sizes interact
  across interval boundaries, so where that schedule scores below the best
  static size the oracle is the best static size (a warning says so): it is
  never below any static size.

Each policy's `PolicyResult` has the serving metrics of its run, its score on
the policy goal and its per-token cost J. Requests longer than the smallest
candidate's pool could never run and are left out; `ReplayReport.warnings`
says so, and names the runs that were overloaded.

The static sizes and the adaptive policy do not depend on one another:
`plan_replay` builds what every policy shares once (the workload, the server,
the interval costs), `ReplayPlan.play` simulates one of them, in any process,
`ReplayPlan.play_oracle` the oracle once the static runs are known, and
`ReplayPlan.report` assembles the report. `replay` does it all in this
process, one policy after another; `blocktune.tuner.sweep` runs the plays as
Dask tasks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from tqdm import tqdm

from blocktune.tuner.config.calibration import Calibration, device_mismatch
from blocktune.tuner.config.engine_settings import engine_settings
from blocktune.tuner.config.policy import Policy
from blocktune.tuner.replay.controllers import AdaptiveController, OracleController, TimelinePoint
from blocktune.tuner.replay.objective import (
    GoalScores,
    IntervalCosts,
    goal_value,
    overloaded,
    within_slo,
)
from blocktune.tuner.sim.forecast import goal_higher_is_better, relative_gain
from blocktune.tuner.sim.served import ServedMetrics
from blocktune.tuner.sim.simulator import Controller, Run, simulate
from blocktune.tuner.sim.step_cost import StepCostModel
from blocktune.tuner.sim.workload import EmptyWorkload, Workload

__all__ = [
    "ADAPTIVE",
    "ORACLE",
    "Played",
    "PolicyResult",
    "ReplayError",
    "ReplayPlan",
    "ReplayReport",
    "TOKENS_PER_S",
    "plan_replay",
    "policy_names",
    "replay",
    "static_name",
]

ADAPTIVE = "adaptive"
ORACLE = "oracle"
TOKENS_PER_S = "tokens_per_s"
"""`ReplayReport.compared_on` where the policies are compared on tokens/s."""
MAX_INTERVALS = 1_000_000  # the objective keeps a row per decision interval of trace time


class ReplayError(ValueError):
    """A replay that cannot run as asked; the message names the bad value."""


def static_name(block_size: int) -> str:
    """The name of the static policy at `block_size`: ``static-16``."""
    return f"static-{block_size}"


@dataclass(frozen=True)
class PolicyResult(ServedMetrics):
    """One policy's serving metrics (`ServedMetrics`: seconds of trace time, bytes of K and
    V across all layers) with what a replay adds.

    `block_size` is None for the policies that change it. `goal_value` is the
    policy goal's score of the run (`objective.goal_value`), `objective` its
    per-token cost J. `replay_s` is the wall-clock time the simulation took.
    """

    policy: str
    block_size: int | None
    mean_kv_bytes: float
    padding_ratio: float
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
        return cls(
            policy=name,
            block_size=block_size,
            **asdict(ServedMetrics.of(run, workload)),  # latencies, peak KV, preemptions
            mean_kv_bytes=run.kv_byte_s / run.end_s if run.end_s > 0 else 0.0,
            padding_ratio=run.padding_ratio,
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
    policy name to its simulated `Run`; `fidelity` is the calibration's fidelity
    check when the replay was given one (`fidelity.fidelity.Fidelity.to_dict`).
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
    fidelity: dict | None = None
    compared_on: str = "goal"
    """What the policies are compared on: ``goal``, or ``tokens_per_s`` where the static runs
    leave no goodput to compare (`ReplayPlan.compared_on`)."""

    def result(self, name: str) -> PolicyResult:
        """The result of the policy called `name` (KeyError if absent)."""
        for result in self.results:
            if result.policy == name:
                return result
        raise KeyError(name)


def policy_names(policy: Policy) -> tuple[str, ...]:
    """The policies a replay of `policy` plays, in report order: static-B per candidate,
    adaptive, oracle."""
    return (*(static_name(size) for size in policy.candidates), ADAPTIVE, ORACLE)


@dataclass(frozen=True)
class Played:
    """One policy's simulation: its run, the adaptive timeline (empty for the other
    policies) and the wall-clock seconds it took."""

    run: Run
    timeline: list[TimelinePoint]
    seconds: float


@dataclass(frozen=True)
class ReplayPlan:
    """What every policy of one replay shares, built once by `plan_replay`.

    `play(name)` simulates a static size or the adaptive policy, in any
    process and in any order; the oracle follows the static runs:
    `oracle_schedule` picks its size per interval from them and
    `play_oracle` simulates it. `report` assembles the `ReplayReport` from
    the `Played` of every name in `names`. `too_long` counts the requests
    left out because they could never fit the pool.
    """

    label: str
    policy: Policy
    calibration: Calibration
    server: StepCostModel
    initial: int
    workload: Workload
    too_long: int
    costs: IntervalCosts

    @property
    def names(self) -> tuple[str, ...]:
        return policy_names(self.policy)

    def play(self, name: str, *, progress: bool = False) -> Played:
        """Simulate the static size or the adaptive policy called `name`; `progress` shows a
        tqdm bar."""
        if name == ADAPTIVE:
            w = self.workload
            controller = AdaptiveController(
                self.policy, self.calibration, w.prompt_tokens, w.output_tokens, w.group
            )
            return self._simulate(name, self.initial, controller, progress)
        for size in self.policy.candidates:
            if name == static_name(size):
                return self._simulate(name, size, None, progress)
        raise ReplayError(f"{name!r} is not a policy played alone: {', '.join(self.names[:-1])}")

    def oracle_schedule(self, played: Mapping[str, Played]) -> np.ndarray:
        """The oracle's size per interval: the best static size of each on the policy goal,
        in hindsight of the static runs in `played`, ties to the best static size of the
        whole run."""
        static = {size: played[static_name(size)].run for size in self.policy.candidates}
        policy = self.policy
        scores = GoalScores.of(
            policy.goal, static, self.workload, self.costs.interval_s, policy.slo
        )
        return scores.best_schedule(self._best_static(played, self.compared_on(played)))

    def _best_static(self, played: Mapping[str, Played], on: str) -> int:
        """The static size that scores best `on` the policy goal or ``tokens_per_s`` (see
        `compared_on`; ties to the smaller)."""
        policy = self.policy
        sign = 1 if on == TOKENS_PER_S or goal_higher_is_better(policy.goal) else -1

        def score(size: int) -> float:
            return sign * self._value(on, played[static_name(size)].run)

        return max(policy.candidates, key=lambda size: (score(size), -size))

    def _value(self, on: str, run: Run) -> float:
        """A run's score on the goal or on ``tokens_per_s``."""
        if on == TOKENS_PER_S:
            return ServedMetrics.of(run, self.workload).tokens_per_s
        return goal_value(self.policy.goal, run, self.workload, self.policy.slo)

    def compared_on(self, played: Mapping[str, Played]) -> str:
        """What the policies are compared on: the ``goal``, or ``tokens_per_s`` where the static
        runs of a capacity goal leave no goodput to compare (`objective.overloaded`)."""
        policy = self.policy
        static = (played[static_name(size)].run for size in policy.candidates)
        if policy.goal == "capacity" and overloaded(static, self.workload, policy.slo):
            return TOKENS_PER_S
        return "goal"

    def play_oracle(self, schedule: np.ndarray, *, progress: bool = False) -> Played:
        """Simulate the oracle following `schedule` (from `oracle_schedule`), swapping free."""
        controller = OracleController(self.costs.interval_s, schedule)
        return self._simulate(ORACLE, int(schedule[0]), controller, progress)

    def _simulate(
        self, name: str, size: int, controller: Controller | None, progress: bool
    ) -> Played:
        start = time.perf_counter()
        with tqdm(
            total=len(self.workload), desc=name, unit="req", leave=False, disable=not progress
        ) as bar:
            run = simulate(self.workload, self.server, size, controller=controller, progress=bar)
        timeline = controller.timeline if isinstance(controller, AdaptiveController) else []
        return Played(run, timeline, time.perf_counter() - start)

    def report(self, played: Mapping[str, Played]) -> ReplayReport:
        """The report of this replay from the `Played` of every name in `names`.

        Sizes interact across interval boundaries (a backlog carries over), so the
        per-interval schedule can score below the best static size; the oracle is then the
        best static size, which a hindsight schedule can always follow, and a warning says
        by how much the schedule fell short."""
        played = dict(played)
        schedule = self.oracle_schedule(played)
        notes = []
        on = self.compared_on(played)
        best = self._best_static(played, on)
        goal = "capacity" if on == TOKENS_PER_S else self.policy.goal
        followed = self._value(on, played[ORACLE].run)
        static = self._value(on, played[static_name(best)].run)
        if relative_gain(goal, followed, static) < 0:
            what = "tokens/s" if on == TOKENS_PER_S else "the goal"
            notes.append(
                f"oracle: the best size of each interval, followed, scored "
                f"{relative_gain(goal, followed, static):+.2%} against static-{best} on {what} "
                f"(sizes interact across interval boundaries), so the oracle is static-{best}"
            )
            played[ORACLE] = played[static_name(best)]
            schedule = np.full(len(schedule), best, dtype=np.int64)
        results = [self._result(name, played[name], schedule) for name in self.names]
        runs = {name: played[name].run for name in self.names}
        trace = _trace_summary(self.label, self.workload, self.too_long)
        return ReplayReport(
            trace=trace,
            policy=_policy_summary(self.policy, self.calibration, self.initial),
            results=results,
            timeline=played[ADAPTIVE].timeline,
            oracle_schedule=schedule,
            compared_on=on,
            interval_s=self.costs.interval_s,
            workload=self.workload,
            runs=runs,
            warnings=[
                *filter(None, [device_mismatch(self.policy, self.calibration)]),
                *replay_warnings(trace, results, runs, self.workload, self.policy),
                *notes,
            ],
        )

    def _result(self, name: str, played: Played, schedule: np.ndarray) -> PolicyResult:
        run, costs = played.run, self.costs
        if name == ADAPTIVE:
            in_force = costs.sizes_in_force(self.initial, run.switches)
            size, objective = None, costs.schedule(in_force, run.swap_pause_s)
        elif name == ORACLE:
            size, objective = None, costs.schedule(schedule)
        else:
            size, objective = run.block_size, costs.static(run.block_size)
        goal = goal_value(self.policy.goal, run, self.workload, self.policy.slo)
        return PolicyResult.of(name, size, run, self.workload, (goal, objective), played.seconds)


def plan_replay(
    frame: pd.DataFrame,
    policy: Policy,
    calibration: Calibration,
    *,
    label: str = "trace",
    initial_block_size: int | None = None,
    fixed_step_s: float | None = None,
) -> ReplayPlan:
    """The shared part of a replay of `frame` (the canonical request table) under `policy`.

    `initial_block_size` is where the adaptive policy starts (default: the policy's
    starting size, `engine_settings`). `fixed_step_s` replaces the calibrated step time
    (see `StepCostModel`).
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
    _check_span(workload, policy.interval.total_seconds(), label)
    return ReplayPlan(
        label=label,
        policy=policy,
        calibration=calibration,
        server=server,
        initial=initial,
        workload=workload,
        too_long=len(loaded) - len(workload),
        costs=IntervalCosts.of(workload, server.cost_model),
    )


def replay(
    frame: pd.DataFrame,
    policy: Policy,
    calibration: Calibration,
    *,
    progress: bool = False,
    **options: Any,
) -> ReplayReport:
    """Replay `frame` under every policy, one after another in this process: the plan of
    `plan_replay` with `options` (`label`, `initial_block_size`, `fixed_step_s`), every play
    and the report. `progress` shows a tqdm bar per policy."""
    plan = plan_replay(frame, policy, calibration, **options)
    played = {name: plan.play(name, progress=progress) for name in plan.names[:-1]}
    played[ORACLE] = plan.play_oracle(plan.oracle_schedule(played), progress=progress)
    return plan.report(played)


def _check_span(workload: Workload, interval_s: float, label: str) -> None:
    """Refuse a trace whose arrivals run past `MAX_INTERVALS` decision intervals."""
    arrivals = workload.arrival_s
    intervals = float(arrivals[-1]) / interval_s
    if intervals < MAX_INTERVALS:
        return
    problem = (
        f"{label}: the last request arrives {float(arrivals[-1]):.4g} s into the trace, "
        f"{intervals:.4g} decision intervals of {interval_s:g} s; a replay holds at most "
        f"{MAX_INTERVALS:,} (use a longer policy interval, or look for a stray timestamp)"
    )
    if len(arrivals) > 1:
        widest = int(np.argmax(np.diff(arrivals)))
        gap = float(arrivals[widest + 1] - arrivals[widest])
        problem += f": the widest gap, {gap:.4g} s, follows the request at {arrivals[widest]:.4g} s"
    raise ReplayError(problem)


def _initial(policy: Policy, requested: int | None) -> int:
    """`requested`, which must be a candidate, else the policy's starting size."""
    if requested is None:
        return engine_settings(policy).block_size
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

SHORT_OF_CAPACITY_SHARE = 0.9
"""A replay whose best static size serves a smaller share of its requests within the SLO warns
that the deployment, not its block size, is what falls short."""


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
    statics = [r for r in results if r.block_size is not None]
    if policy.goal == "capacity" and statics:
        best = max(statics, key=lambda r: r.goal_value)
        share = float(within_slo(runs[best.policy], workload, policy.slo).mean())
        if share < SHORT_OF_CAPACITY_SHARE:
            warnings.append(
                f"even the best static size ({best.policy}) serves only {share:.0%} of the "
                f"requests within the SLO (TTFT <= {policy.slo.ttft_p99_s:g} s, TPOT <= "
                f"{policy.slo.tpot_p99_s * 1e3:g} ms): this deployment is short of capacity "
                "for the traffic, and the block size decides only how much of the overflow is "
                "still served in time"
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
