"""Offline replay: every block-size policy served the same trace on a simulated server.

`replay(frame, policy, calibration)` plays the trace through the serving
simulator (`replay_sim`: continuous batching, a paged KV cache of the policy's
budget, preemption by recompute, prefix reuse, step times from the
calibration) once per policy:

- ``static-B`` for every candidate B of the policy;
- ``adaptive``: the real LengthWindow + Selector deciding every
  `policy.interval` of trace time (`replay_control.AdaptiveController`), each
  switch charged its modelled swap pause;
- ``oracle``: the best static size of each interval in hindsight, swapped for
  free (`replay_objective`); its objective bounds the others from below.

Each policy's `PolicyResult` has the serving metrics of its run and the
objective of `replay_objective` (seconds per generated token, as the cost
model prices it). Requests longer than the smallest candidate's pool could
never run and are left out (counted in the trace summary).

The policies do not depend on one another: `plan_replay` builds what they
share once (the workload, the server, the interval costs, the oracle's
schedule), `ReplayPlan.play` simulates one of them, in any process, and
`ReplayPlan.report` assembles the report. `replay` does all three in this
process, one policy after another; `blocktune.tuner.sweep` runs the plays as
Dask tasks.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from tqdm import tqdm

from blocktune.tuner.core.calibration import Calibration
from blocktune.tuner.core.defaults import DEFAULT_BLOCK_SIZE
from blocktune.tuner.core.policy import Policy, nearest_power_of_two
from blocktune.tuner.replay.controllers import AdaptiveController, OracleController, TimelinePoint
from blocktune.tuner.replay.objective import IntervalCosts
from blocktune.tuner.replay.simulator import Controller, Run, simulate
from blocktune.tuner.replay.step_cost import StepCostModel
from blocktune.tuner.replay.workload import EmptyWorkload, Workload

__all__ = [
    "ADAPTIVE",
    "ORACLE",
    "Played",
    "PolicyResult",
    "ReplayError",
    "ReplayPlan",
    "ReplayReport",
    "plan_replay",
    "policy_names",
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
    over the replay's span. `replay_s` is the wall-clock time the simulation took.
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
        objective: float,
        replay_s: float,
    ) -> PolicyResult:
        """Summarise a simulated run."""
        arrival = workload.arrival_s
        outputs = workload.output_tokens
        ttft = run.first_token_s - arrival
        e2e = run.finish_s - arrival
        later = outputs > 1
        tpot = (run.finish_s[later] - run.first_token_s[later]) / (outputs[later] - 1)
        span = run.end_s - float(arrival[0])
        ttft_p50, ttft_p99 = np.percentile(ttft, [50, 99])
        tpot_p50, tpot_p99 = np.percentile(tpot, [50, 99]) if len(tpot) else (np.nan, np.nan)
        return cls(
            policy=name,
            block_size=block_size,
            tokens_per_s=float(run.generated.sum()) / span if span > 0 else float("nan"),
            ttft_p50_s=float(ttft_p50),
            ttft_p99_s=float(ttft_p99),
            tpot_p50_s=float(tpot_p50),
            tpot_p99_s=float(tpot_p99),
            e2e_p99_s=float(np.percentile(e2e, 99)),
            peak_kv_bytes=int(run.peak_kv_bytes),
            mean_kv_bytes=run.kv_byte_s / run.end_s if run.end_s > 0 else 0.0,
            padding_ratio=run.padding_ratio,
            preemptions=run.preemptions,
            swaps=run.swaps,
            objective=objective,
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

    The policies are independent of one another: `play(name)` simulates one
    of `names` (in any process), and `report` turns the `Played` of each
    into the `ReplayReport`. `oracle_schedule[i]` is the oracle's size in
    interval i; `too_long` counts the requests left out because they could
    never fit the pool.
    """

    label: str
    policy: Policy
    calibration: Calibration
    server: StepCostModel
    initial: int
    workload: Workload
    too_long: int
    costs: IntervalCosts
    oracle_schedule: np.ndarray

    @property
    def names(self) -> tuple[str, ...]:
        return policy_names(self.policy)

    def play(self, name: str, *, progress: bool = False) -> Played:
        """Simulate the policy called `name`; `progress` shows a tqdm bar."""
        size, controller = self._controller(name)
        start = time.perf_counter()
        with tqdm(
            total=len(self.workload), desc=name, unit="req", leave=False, disable=not progress
        ) as bar:
            run = simulate(self.workload, self.server, size, controller=controller, progress=bar)
        timeline = controller.timeline if isinstance(controller, AdaptiveController) else []
        return Played(run, timeline, time.perf_counter() - start)

    def _controller(self, name: str) -> tuple[int, Controller | None]:
        """The size the policy starts at and what changes it (None: nothing)."""
        if name == ADAPTIVE:
            w = self.workload
            controller = AdaptiveController(
                self.policy, self.calibration, w.prompt_tokens, w.output_tokens, w.group
            )
            return self.initial, controller
        if name == ORACLE:
            schedule = self.oracle_schedule
            return int(schedule[0]), OracleController(self.costs.interval_s, schedule)
        for size in self.policy.candidates:
            if name == static_name(size):
                return size, None
        raise ReplayError(f"{name!r} is not a policy of this replay: {', '.join(self.names)}")

    def report(self, played: Mapping[str, Played]) -> ReplayReport:
        """The report of this replay from the `Played` of every name in `names`."""
        return ReplayReport(
            trace=_trace_summary(self.label, self.workload, self.too_long),
            policy=_policy_summary(self.policy, self.calibration, self.initial),
            results=[self._result(name, played[name]) for name in self.names],
            timeline=played[ADAPTIVE].timeline,
            oracle_schedule=self.oracle_schedule,
            interval_s=self.costs.interval_s,
            workload=self.workload,
            runs={name: played[name].run for name in self.names},
        )

    def _result(self, name: str, played: Played) -> PolicyResult:
        run, costs = played.run, self.costs
        if name == ADAPTIVE:
            in_force = costs.sizes_in_force(self.initial, run.switches)
            size, objective = None, costs.schedule(in_force, run.swap_pause_s)
        elif name == ORACLE:
            size, objective = None, costs.schedule(self.oracle_schedule)
        else:
            size, objective = run.block_size, costs.static(run.block_size)
        return PolicyResult.of(name, size, run, self.workload, objective, played.seconds)


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

    `initial_block_size` is where the adaptive policy starts (default: the
    candidate nearest 16). `fixed_step_s` replaces the calibrated step time
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
    costs = IntervalCosts.of(workload, server.cost_model)
    return ReplayPlan(
        label=label,
        policy=policy,
        calibration=calibration,
        server=server,
        initial=initial,
        workload=workload,
        too_long=len(loaded) - len(workload),
        costs=costs,
        oracle_schedule=costs.best_schedule(),
    )


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
    """Replay `frame` under every policy, one after another in this process; see the module
    doc and `plan_replay`. `progress` shows a tqdm bar per policy."""
    plan = plan_replay(
        frame,
        policy,
        calibration,
        label=label,
        initial_block_size=initial_block_size,
        fixed_step_s=fixed_step_s,
    )
    return plan.report({name: plan.play(name, progress=progress) for name in plan.names})


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
        "initial_block_size": initial,
        "calibration": calibration.describe(),
    }
