"""Fidelity of the simulator: the same workload served live and simulated, per block size.

For every block size B, `validate` serves the workload on the live engine
(`tuner.fidelity.live`, a virtual clock advanced by each step's measured time)
`runs` times, and once on the simulator (`tuner.sim.simulator`) with the same
pool: the policy's KV budget in whole blocks of B, for the live model's shape
(the policy's `model` section is replaced by it), priced by the calibration.
The live steps are timed with the clock of the calibration's engine section.
Given an `InterleavedGrid` instead of a calibration's engine section,
`validate` measures that section itself, during the live runs: the grid's
points are shared out to the live runs, and each run times its share between
its steps, as far through its share as it is through its output tokens
(`tuner.measure.engine_measure.GridTimer`); the steps are fitted once every run
is done, and only then is anything predicted. On a shared machine, whose speed
swings by tens of percent within seconds (the CPU clock does not take that
out: bench/results/2026-12-07-calibration-fidelity.md), a calibration timed
before the live runs prices them at the speed of its own half minute; timed
between their steps, it sees the machine as they do.
The engine takes the policy's engine settings (`tuner.config.engine_settings`:
`max_num_seqs`, `max_num_batched_tokens` for chunked prefill, and the prefix
cache, on unless turned off or prefills are chunked), as the simulator does.

`BlockSizeCheck` holds the predicted and the measured metrics; the relative
error is predicted / measured - 1 (against the mean of the live runs), and its
noise is the spread of the live runs relative to their mean. A calibration
measured between the live runs also has a noise of its own: each block size is
predicted again with `CALIBRATION_DRAWS` of the fit's refits on resampled
timing moments (`tuner.measure.step_fit`), and their relative standard
deviation is how far another validation's calibration, timed at other moments
of the same machine, would move the prediction. Both sides rank
the block sizes by each of `RANK_METRICS` (tokens/s, TPOT p50, TTFT p99); per
metric, a pair of block sizes is compared only where their measured means differ
beyond the run-to-run noise, by a two-sided t-test at `RANK_CONFIDENCE` on the
live runs' variance pooled over the block sizes (`Validation.apart`), and by
more than `RANK_TIE`; other pairs are ties. With three sizes of two runs each
and normal noise, a pair the engine serves alike is compared 5% of the time
(a validation with any such pair: 10%); the rule before, the widest spread of
any size's runs, compared it 14% of the time (26%), and tiny-random's live runs
on the Azure lengths put B=8 and B=64 up to 1.2x apart either way, run to run.
A metric with no pair compared has no agreement to report (`Ranking.agreement`
is None). The live runs go round-robin over the block sizes (run i of every size
before run i + 1 of any), so drift of the machine shows as run-to-run noise, not
as a block-size effect;
with `jobs` above 1 they are served by that many worker processes at once
(`tuner.measure.processes`), and a tqdm bar follows them through their output
tokens (each run reports every `LIVE_REPORT_FRACTION`, through a queue the
worker processes share with this one). Each live engine is freed before its process
builds the next, so at most `jobs` pools are allocated at a time.

Near saturation a small error in the step price becomes a large one in the
latencies: each slower step leaves more requests in flight, which makes the
next step slower still. So every check also carries a `StepSensitivity`: how
much the predicted TPOT p50 moves when every step takes `SENSITIVITY_SCALE`
times as long, and the step-time scale at which the simulator's TPOT p50 equals
the measured one (found by bisection on `StepCostModel.step_scale`). The scale
is the calibration's error on the live steps as this workload served them; the
TPOT error divided by it is how much the workload amplifies that error.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import scipy.stats

from blocktune.tuner.config.calibration import Calibration
from blocktune.tuner.config.policy import Policy
from blocktune.tuner.fidelity.live import serve_live
from blocktune.tuner.fidelity.served_metrics import (
    HIGHER_IS_BETTER,
    mean_of,
    predict,
    prediction_method,
)
from blocktune.tuner.measure.engine_measure import EngineGrid
from blocktune.tuner.measure.processes import map_in_processes
from blocktune.tuner.measure.step_fit import TimedStep, fit_steps
from blocktune.tuner.sim.served import ServedMetrics
from blocktune.tuner.sim.simulator import simulate
from blocktune.tuner.sim.step_cost import StepCostModel
from blocktune.tuner.sim.workload import Workload

if TYPE_CHECKING:
    from blocktune.runtime.model import LlamaModel

__all__ = [
    "CALIBRATION_DRAWS",
    "POOL_LIMIT",
    "POSITIONS_LIMIT",
    "RANK_CONFIDENCE",
    "RANK_METRICS",
    "BlockSizeCheck",
    "InterleavedGrid",
    "Ranking",
    "StepSensitivity",
    "Validation",
    "left_out",
    "pool_slots",
    "step_sensitivity",
    "validate",
]


# What sets the most tokens a request of a check may hold (`left_out`).
POSITIONS_LIMIT = "the model's positions, max_position_embeddings"
POOL_LIMIT = "the smallest KV pool of the block sizes compared"
RANK_METRICS = ("tokens_per_s", "tpot_p50_s", "ttft_p99_s")
"""The metrics both sides rank the block sizes by."""
RANK_TIE = 0.01
"""Measured values within this fraction of each other rank as ties whatever the noise: when
tokens/s follows the arrivals, live runs repeat it exactly and block sizes differ by 0.01%."""
RANK_CONFIDENCE = 0.95
"""The confidence at which two block sizes' measured means must differ to be compared: the
chance that two sizes the engine serves alike are compared is 1 - this, per pair."""
CALIBRATION_DRAWS = 16
"""Refits of a calibration measured between the live runs (`StepFit.replicates`) that every
block size is predicted with again: the spread of those predictions is the calibration's own
noise on them."""

LIVE_REPORT_FRACTION = 0.01
"""A live run reports its progress to the live runs' bar each time it has served this much
more of its output tokens."""


SENSITIVITY_SCALE = 1.1
"""Every step this many times as long: the step-time change a sensitivity is reported for."""
MATCHING_SCALE_RANGE = (0.25, 4.0)
"""The step-time scales searched for the one at which the predicted TPOT p50 is measured."""
MATCHING_SCALE_TOLERANCE = 0.01
"""The bisection stops when the scale is known within this fraction."""


@dataclass(frozen=True)
class InterleavedGrid:
    """An engine calibration for `validate` to measure between the live runs' steps (module
    docstring): the grid, the name of the model it records, and the clock that times both."""

    grid: EngineGrid
    model_name: str
    clock: str


@dataclass(frozen=True)
class StepSensitivity:
    """How one block size's predicted TPOT p50 follows the step time (module docstring):
    its relative change with every step `SENSITIVITY_SCALE` times as long, and the step-time
    scale at which it equals the measured TPOT p50 (None outside `MATCHING_SCALE_RANGE`, or
    without a TPOT to match)."""

    tpot_p50_change: float
    matching_step_scale: float | None


@dataclass(frozen=True)
class BlockSizeCheck:
    """One block size: the simulator's prediction, the live runs and, where the calibration
    was measured between them, the predictions with its refits (`predicted_draws`)."""

    block_size: int
    predicted: ServedMetrics
    measured_runs: tuple[ServedMetrics, ...]
    sensitivity: StepSensitivity | None = None
    predicted_draws: tuple[ServedMetrics, ...] = ()

    @property
    def measured(self) -> ServedMetrics:
        return mean_of(self.measured_runs)

    def error(self, metric: str) -> float:
        """predicted / measured - 1 (0 when both are 0, nan when only the measurement is)."""
        predicted, measured = getattr(self.predicted, metric), getattr(self.measured, metric)
        if predicted == measured:
            return 0.0
        return predicted / measured - 1 if measured else math.nan

    def calibration_noise(self, metric: str) -> float:
        """The standard deviation of the predictions with the calibration's refits, relative
        to the prediction (nan with fewer than two, or a zero prediction)."""
        values = [getattr(d, metric) for d in self.predicted_draws]
        predicted = getattr(self.predicted, metric)
        if len(values) < 2 or not predicted:
            return math.nan
        return float(np.std(values, ddof=1)) / abs(predicted)

    def noise(self, metric: str) -> float:
        """Spread of the live runs over their mean (nan with one run or a zero mean)."""
        values = [getattr(r, metric) for r in self.measured_runs]
        mean = float(np.mean(values))
        if len(values) < 2 or not mean:
            return math.nan
        return (max(values) - min(values)) / abs(mean)


@dataclass(frozen=True)
class Ranking:
    """How both sides order the block sizes by one metric: the orders (best first), the
    pairs whose measured values differ beyond the noise, and how many of them the prediction
    orders the same way (a predicted tie on such a pair is not the same way; `predicted_ties`
    counts those ties: sizes the calibration prices alike that the live runs set apart).
    `agreement` is None when no pair was compared. The texts show the orders with "="
    between equal values."""

    metric: str
    predicted: list[int]
    measured: list[int]
    compared: int
    agreeing: int
    predicted_text: str = ""
    measured_text: str = ""
    predicted_ties: int = 0

    @property
    def agreement(self) -> bool | None:
        return None if not self.compared else self.agreeing == self.compared


@dataclass(frozen=True)
class Validation:
    """Every block size's check on one workload, and how both sides rank them by each of
    `RANK_METRICS`; `calibration`, where known, is the one that priced the predictions."""

    trace: dict
    setup: dict
    checks: list[BlockSizeCheck]
    calibration: Calibration | None = None

    def ranking(self, side: str, metric: str) -> list[int]:
        """Block sizes best first by `metric`, as `side` ("predicted" or "measured") has it."""
        sign = -1 if metric in HIGHER_IS_BETTER else 1
        ordered = sorted(self.checks, key=lambda c: sign * getattr(getattr(c, side), metric))
        return [c.block_size for c in ordered]

    def noise(self, metric: str) -> tuple[float, int]:
        """The run-to-run standard deviation of `metric`, pooled over the block sizes (each
        run against its own size's mean), and its degrees of freedom (0, with a deviation of
        0, where no size has two runs)."""
        runs = [[getattr(r, metric) for r in c.measured_runs] for c in self.checks]
        freedom = sum(len(values) - 1 for values in runs)
        if not freedom:
            return 0.0, 0
        squares = sum(float(np.sum((np.array(v) - np.mean(v)) ** 2)) for v in runs)
        return math.sqrt(squares / freedom), freedom

    def apart(self, metric: str, a: BlockSizeCheck, b: BlockSizeCheck) -> bool:
        """Whether `a` and `b`'s measured means of `metric` differ by more than `RANK_TIE` of
        the larger and, where the runs measure a noise, beyond it: by more than Student's t
        quantile at `RANK_CONFIDENCE` (two-sided) times the pooled deviation's standard
        error of the difference."""
        first, second = getattr(a.measured, metric), getattr(b.measured, metric)
        difference = abs(first - second)
        if difference <= RANK_TIE * max(abs(first), abs(second)):
            return False
        deviation, freedom = self.noise(metric)
        if not freedom:
            return True
        quantile = float(scipy.stats.t.ppf(0.5 + RANK_CONFIDENCE / 2, freedom))
        error = deviation * math.sqrt(1 / len(a.measured_runs) + 1 / len(b.measured_runs))
        return difference > quantile * error

    def compared_pairs(self, metric: str) -> list[tuple[BlockSizeCheck, BlockSizeCheck]]:
        """Pairs of block sizes whose measured `metric` is `apart`."""
        return [
            (a, b)
            for i, a in enumerate(self.checks)
            for b in self.checks[i + 1 :]
            if self.apart(metric, a, b)
        ]

    def rank(self, metric: str) -> Ranking:
        """Both sides' order by `metric` and their agreement on the pairs beyond the noise."""
        pairs = self.compared_pairs(metric)
        agreeing = sum(
            np.sign(getattr(a.predicted, metric) - getattr(b.predicted, metric))
            == np.sign(getattr(a.measured, metric) - getattr(b.measured, metric))
            for a, b in pairs
        )
        ties = sum(getattr(a.predicted, metric) == getattr(b.predicted, metric) for a, b in pairs)
        return Ranking(
            metric,
            self.ranking("predicted", metric),
            self.ranking("measured", metric),
            compared=len(pairs),
            agreeing=int(agreeing),
            predicted_text=self._order_text("predicted", metric),
            measured_text=self._order_text("measured", metric),
            predicted_ties=int(ties),
        )

    def _order_text(self, side: str, metric: str) -> str:
        """The order best first, "=" joining block sizes of equal values ("16 8=64")."""
        value = {c.block_size: getattr(getattr(c, side), metric) for c in self.checks}
        order = self.ranking(side, metric)
        text = str(order[0])
        for before, size in zip(order, order[1:], strict=False):
            text += "=" if math.isclose(value[before], value[size], rel_tol=1e-9) else " "
            text += str(size)
        return text

    @property
    def rankings(self) -> list[Ranking]:
        """`rank` for each of `RANK_METRICS`."""
        return [self.rank(metric) for metric in RANK_METRICS]

    def median_abs_error(self, metric: str) -> float:
        """The median over block sizes of |relative error| of `metric` (nan if none exists)."""
        return _median([abs(c.error(metric)) for c in self.checks])

    def median_calibration_noise(self, metric: str) -> float:
        """The median over block sizes of the calibration's noise on `metric` (nan without
        refits)."""
        return _median([c.calibration_noise(metric) for c in self.checks])


def _median(values: list[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return float(np.median(kept)) if kept else math.nan


def validate(
    workload: Workload,
    policy: Policy,
    model: LlamaModel,
    calibration: Calibration,
    block_sizes: tuple[int, ...],
    *,
    runs: int = 2,
    step_s: float | None = None,
    seed: int = 0,
    jobs: int = 1,
    interleave: InterleavedGrid | None = None,
    progress: Callable[[str], None] = lambda _: None,
    live_bar: bool | None = None,
) -> Validation:
    """Serve `workload` live `runs` times and simulated once per block size (module doc).
    Requests longer than the smallest pool or the model's positions are left out.

    `step_s` replaces both sides' step times by a constant (a deterministic comparison
    of their scheduling). `jobs` worker processes serve the live runs at once (1: here,
    one after another). With `interleave`, the calibration's engine section is measured
    between the live runs' steps (and replaces any it has). Raises `CalibrationError` for
    a calibration that cannot price the model or a block size. A tqdm bar follows the live
    runs through their output tokens (`live_bar`: None shows it where stderr is a terminal)."""
    plan = _plan(workload, policy, model, calibration, block_sizes, runs, interleave)
    live = _serve_live_runs(
        plan, model, calibration, step_s, seed, jobs, interleave, progress, live_bar
    )
    calibration, draws = _refit(
        plan, model, calibration, interleave, live, step_s, seed, jobs, progress
    )
    server = StepCostModel(plan.served, calibration, step_s)
    checks = _predict(plan, server, [metrics for metrics, _ in live], draws, seed, progress)
    trace = left_out(workload, plan.workload, plan.token_limit, plan.limited_by)
    setup = {
        "kv_budget_bytes": int(plan.served.kv_budget),
        "pool_blocks": {b: server.num_blocks(b) for b in plan.sizes},
        "calibration": calibration.describe(),
        "block_size_effect": (
            calibration.engine.block_size_verdict() if calibration.engine is not None else None
        ),
        "runs": runs,
        "calibration_draws": len(draws),
        "prediction": prediction_method(server, seed),
    }
    return Validation(trace=trace, setup=setup, checks=checks, calibration=calibration)


@dataclass(frozen=True)
class _Plan:
    """What `validate` serves: the policy as served (the live model's shape, the block sizes
    as its candidates), the workload kept (requests of at most `token_limit` tokens, a limit
    `limited_by` sets), the block size of each live run in the order they are served, and
    the clock that times their steps."""

    served: Policy
    workload: Workload
    token_limit: int
    limited_by: str
    order: tuple[int, ...]
    clock: str

    @property
    def sizes(self) -> tuple[int, ...]:
        return self.served.candidates


def _plan(
    workload: Workload,
    policy: Policy,
    model: LlamaModel,
    calibration: Calibration,
    block_sizes: tuple[int, ...],
    runs: int,
    interleave: InterleavedGrid | None,
) -> _Plan:
    """Check `validate`'s inputs and plan its live runs: run i of every size before run
    i + 1 of any, so that drift of the machine shows as run-to-run noise rather than as a
    difference between block sizes."""
    from blocktune.tuner.measure.engine_measure import check_clock, check_grid

    if runs < 1:
        raise ValueError(f"need runs >= 1, got {runs}")
    if policy.engine != "blocktune":
        raise ValueError(f"the live side is blocktune's engine; the policy models {policy.engine}")
    calibration.require(block_sizes)
    if interleave is not None:
        clock = interleave.clock
        check_grid(interleave.grid, model, clock)
    else:
        clock = calibration.engine.clock if calibration.engine is not None else "wall"
        check_clock(clock, model)
    served = _served_policy(policy, model, block_sizes)
    positions = model.config.max_position_embeddings
    pool = pool_slots(policy, model, calibration, block_sizes)
    limit, limited_by = (positions, POSITIONS_LIMIT) if positions <= pool else (pool, POOL_LIMIT)
    order = tuple(b for _ in range(runs) for b in served.candidates)
    return _Plan(served, workload.without_longer_than(limit), limit, limited_by, order, clock)


def _serve_live_runs(
    plan: _Plan,
    model: LlamaModel,
    calibration: Calibration,
    step_s: float | None,
    seed: int,
    jobs: int,
    interleave: InterleavedGrid | None,
    progress: Callable[[str], None],
    live_bar: bool | None,
) -> list[tuple[ServedMetrics, list[TimedStep]]]:
    """Serve the plan's live runs in `jobs` processes, each timing its share of the
    interleaved grid's points between its steps: every run's metrics and timed steps."""
    import torch

    order = plan.order
    tasks = [
        _LiveTask(i, b, None if interleave is None else len(order)) for i, b in enumerate(order)
    ]
    grid = None if interleave is None else interleave.grid
    where = "" if grid is None else f", timing {grid.num_points} grid points between their steps"
    runs = len(order) // len(plan.sizes)
    progress(f"{len(order)} live runs, {runs} per block size, in {jobs} process(es){where}")
    with _LiveRunsBar(len(order), jobs, live_bar) as bar:
        return map_in_processes(
            partial(
                _live_run,
                model,
                StepCostModel(plan.served, calibration),
                plan.workload,
                step_s,
                plan.clock,
                seed,
                grid,
                calibration.provenance.backend,
                bar.reports,
            ),
            tasks,
            jobs=jobs,
            threads=torch.get_num_threads(),
            done=lambda finished, total: progress(f"live run {finished} of {total} done"),
        )


def _refit(
    plan: _Plan,
    model: LlamaModel,
    calibration: Calibration,
    interleave: InterleavedGrid | None,
    live: list[tuple[ServedMetrics, list[TimedStep]]],
    step_s: float | None,
    seed: int,
    jobs: int,
    progress: Callable[[str], None],
) -> tuple[Calibration, list[StepCostModel]]:
    """The calibration that prices the predictions and the servers of its refits: with an
    interleaved grid, its engine section fitted to the steps the live runs timed, and (for
    measured step times) `CALIBRATION_DRAWS` of the fit's refits; else `calibration` and
    none."""
    from blocktune.tuner.measure.engine_measure import describe_fit, fitted_engine_calibration

    if interleave is None:
        return calibration, []
    fit = fit_steps([step for _, timed in live for step in timed], seed=seed)
    engine = fitted_engine_calibration(
        model,
        interleave.model_name,
        interleave.grid,
        calibration.provenance.backend,
        fit,
        clock=plan.clock,
        how=(
            f"by `blocktune validate`, between the steps of {len(plan.order)} live runs in "
            f"{jobs} process(es)"
        ),
    )
    for line in describe_fit(engine):
        progress(line)
    calibration = calibration.with_engine(engine)
    if step_s is not None:
        return calibration, []
    draws = [
        StepCostModel(
            plan.served, calibration.with_engine(engine.model_copy(update={"steps": refit}))
        )
        for refit in fit.replicates[:CALIBRATION_DRAWS]
    ]
    return calibration, draws


def _predict(
    plan: _Plan,
    server: StepCostModel,
    measured: list[ServedMetrics],
    draws: list[StepCostModel],
    seed: int,
    progress: Callable[[str], None],
) -> list[BlockSizeCheck]:
    """Each block size's check: its prediction on `server`, its live runs (`measured`, in
    the plan's order), the prediction's sensitivity to the step time, and its predictions
    with the calibration's refits (`draws`)."""
    checks = []
    for b in plan.sizes:
        progress(f"B={b}: simulating")
        predicted = predict(plan.workload, server, b, seed=seed)
        runs_of_b = tuple(m for size, m in zip(plan.order, measured, strict=True) if size == b)
        progress(f"B={b}: the prediction's sensitivity to the step time")
        sensitivity = step_sensitivity(plan.workload, server, b, predicted, mean_of(runs_of_b))
        if draws:
            progress(f"B={b}: predicting with {len(draws)} refits of the calibration")
        again = tuple(predict(plan.workload, d, b, seed=seed) for d in draws)
        checks.append(BlockSizeCheck(b, predicted, runs_of_b, sensitivity, again))
    return checks


def left_out(workload: Workload, kept: Workload, token_limit: int, limited_by: str) -> dict:
    """A check's trace section: its requests, how many it left out as longer than
    `token_limit` tokens, that limit and what sets it (`POSITIONS_LIMIT`, `POOL_LIMIT`)."""
    return {
        "requests": len(workload),
        "too_long": len(workload) - len(kept),
        "token_limit": token_limit,
        "token_limit_of": limited_by,
    }


def pool_slots(
    policy: Policy, model: LlamaModel, calibration: Calibration, block_sizes: tuple[int, ...]
) -> int:
    """Token slots of the smallest of validate's live pools (the policy's KV budget at
    `model`'s K/V bytes per token, in whole blocks of each of `block_sizes`): the most tokens
    a request, or a step's requests together, hold there."""
    server = StepCostModel(_served_policy(policy, model, block_sizes), calibration)
    return min(server.capacity_slots(b) for b in block_sizes)


def _served_policy(policy: Policy, model: LlamaModel, block_sizes: tuple[int, ...]) -> Policy:
    """`policy` with `model`'s shape and `block_sizes` as its candidates: what validate serves."""
    from blocktune.tuner.measure.engine_measure import model_shape

    return Policy.model_validate(
        {**dict(policy), "model": model_shape(model), "candidates": block_sizes}
    )


def step_sensitivity(
    workload: Workload,
    server: StepCostModel,
    block_size: int,
    predicted: ServedMetrics,
    measured: ServedMetrics,
) -> StepSensitivity:
    """The `StepSensitivity` of `predicted` (`served_metrics.predict` for `workload` on
    `server` at `block_size`) against `measured`: its TPOT p50 comes from the run at the
    fitted step times, so the scaled runs are priced at theirs."""

    def tpot_p50(scale: float) -> float:
        if scale == 1:
            return predicted.tpot_p50_s
        scaled = replace(server, step_scale=server.step_scale * scale, sample_spread=False)
        return ServedMetrics.of(simulate(workload, scaled, block_size), workload).tpot_p50_s

    base = predicted.tpot_p50_s
    change = tpot_p50(SENSITIVITY_SCALE) / base - 1 if base > 0 else math.nan
    return StepSensitivity(change, _matching_scale(tpot_p50, measured.tpot_p50_s))


def _matching_scale(tpot_p50: Callable[[float], float], target: float) -> float | None:
    """The step-time scale at which `tpot_p50(scale)` reaches `target`: bisected in the log
    of the scale within `MATCHING_SCALE_RANGE` (None outside it, or without a target)."""
    low, high = MATCHING_SCALE_RANGE
    if not target > 0 or not tpot_p50(low) <= target <= tpot_p50(high):
        return None
    while high / low > 1 + MATCHING_SCALE_TOLERANCE:
        middle = math.sqrt(low * high)
        if tpot_p50(middle) < target:
            low = middle
        else:
            high = middle
    return math.sqrt(low * high)


@dataclass(frozen=True)
class _LiveTask:
    """One live run: its number, its block size and, where the calibration is measured
    between its steps, how many runs share the grid's points (its share: every
    `grid_sharers`-th point from its number on)."""

    number: int
    block_size: int
    grid_sharers: int | None


class _LiveRunsBar:
    """A tqdm bar over the live runs (each counts 1 when all its output tokens are served),
    fed by the runs' reports of (run number, fraction served) through `reports`: a queue
    that worker processes can put to, or None where the bar is not shown (`show` None: where
    stderr is not a terminal), and the runs report nothing."""

    def __init__(self, runs: int, jobs: int, show: bool | None) -> None:
        import queue
        import sys

        from tqdm import tqdm

        self._bar = tqdm(
            total=runs,
            desc="live runs",
            unit="run",
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.2f}/{total} [{elapsed}<{remaining}]",
            disable=not sys.stderr.isatty() if show is None else not show,
        )
        self._manager = None
        self.reports = None
        if not self._bar.disable:
            if jobs > 1:
                import multiprocessing

                self._manager = multiprocessing.get_context("spawn").Manager()
                self.reports = self._manager.Queue()
            else:
                self.reports = queue.Queue()
        self._served: dict[int, float] = {}
        self._thread = None

    def __enter__(self) -> _LiveRunsBar:
        import threading

        if self.reports is not None:
            self._thread = threading.Thread(target=self._follow, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        if self._thread is not None:
            self.reports.put(None)
            self._thread.join()
        if self._manager is not None:
            self._manager.shutdown()
        self._bar.close()

    def _follow(self) -> None:
        while (report := self.reports.get()) is not None:
            number, fraction = report
            self._served[number] = fraction
            self._bar.n = sum(self._served.values())  # not summed deltas: a full bar at the end
            self._bar.refresh()


def _live_run(
    model: LlamaModel,
    server: StepCostModel,
    workload: Workload,
    step_s: float | None,
    clock: str,
    seed: int,
    grid: EngineGrid | None,
    backend: str,
    reports,
    task: _LiveTask,
) -> tuple[ServedMetrics, list[TimedStep]]:
    """One live run of `workload` at the task's block size, timing its share of `grid`'s
    points between its steps and putting (its number, fraction of the output tokens served)
    to `reports` (a queue, or None) every `LIVE_REPORT_FRACTION`; its engines and pools are
    freed on return. The model is warm before the first live step (`GridTimer`'s engines
    warm it, or `warm_up_model`)."""
    from blocktune.tuner.measure.engine_measure import STEP_CLOCKS, GridTimer, warm_up_model

    timer = None
    if grid is not None and task.grid_sharers is not None:
        share = (task.number, range(task.number, grid.num_points, task.grid_sharers))
        timer = GridTimer(model, grid, backend, clock, seed, share)
    else:
        warm_up_model(model, backend)
    reported = 0.0

    def between(fraction: float) -> None:
        nonlocal reported
        if timer is not None:
            timer.time_until(fraction)
        if reports is not None and (fraction == 1 or fraction >= reported + LIVE_REPORT_FRACTION):
            reports.put((task.number, fraction))
            reported = fraction

    engine = _engine(model, server, task.block_size, workload)
    live = serve_live(
        engine,
        workload,
        step_s=step_s,
        timer=STEP_CLOCKS[clock],
        seed=seed,
        between=between,
    )
    del engine  # free this pool before the next one is allocated
    steps = [] if timer is None else timer.close()
    gc.collect()
    return ServedMetrics.of(live, workload), steps


def _engine(model: LlamaModel, server: StepCostModel, block_size: int, workload: Workload):
    """A fresh engine with the simulator's pool at `block_size` and the policy's engine
    settings (its batch limits and prefix cache, as the simulator has them; the attention
    backend `blocktune calibrate` measures: `default_backend`)."""
    from blocktune.runtime.engine import Engine
    from blocktune.tuner.config.engine_settings import engine_settings

    settings = engine_settings(
        server.policy,
        num_blocks=server.num_blocks(block_size),
        block_size=block_size,
        candidates=(block_size,),
        max_model_len=int(workload.total_tokens.max()),
    )
    return Engine(model, settings.engine_config())
