"""What a fidelity check compares of a served run (`sim.served.ServedMetrics`), and the
simulator's prediction of it."""

from __future__ import annotations

from dataclasses import fields, replace

import numpy as np

from blocktune.tuner.sim.served import ServedMetrics
from blocktune.tuner.sim.simulator import SPREAD_HOLD_S, simulate
from blocktune.tuner.sim.step_cost import StepCostModel
from blocktune.tuner.sim.workload import Workload

__all__ = ["HIGHER_IS_BETTER", "METRICS", "compared", "mean_of", "predict", "prediction_method"]

METRICS = (
    "tokens_per_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "tpot_p99_s",
    "peak_kv_blocks",
    "preemptions",
)
"""The compared fields of `ServedMetrics`, in table order (the pool's use in blocks: a vLLM
server reports blocks)."""

HIGHER_IS_BETTER = ("tokens_per_s",)
"""Metrics where more is better; for every other one less is."""


def compared(metrics: ServedMetrics) -> dict[str, float]:
    """The `METRICS` of `metrics`, by name."""
    return {key: getattr(metrics, key) for key in METRICS}


def predict(
    workload: Workload, server: StepCostModel, block_size: int, *, seed: int = 0
) -> ServedMetrics:
    """The simulator's prediction for `workload` at `block_size`: tokens/s, the p50s, the
    peak KV and the preemptions of a run at the fitted step times, the p99s of a run
    whose steps are scaled by factors drawn from the calibration's step spread (`seed`;
    each held for a stretch of simulated time, `simulator.SPREAD_HOLD_S`); one run
    where the calibration has no spread.

    The spread is a distribution over all the grid's steps, so it widens the tails as
    the live steps do; but drawn at random it also moves which requests decode while a
    long prompt is computed, which the central figures of a saturated run follow (see
    docs/architecture.md)."""
    fitted = replace(server, sample_spread=False)
    central = ServedMetrics.of(simulate(workload, fitted, block_size), workload)
    if not server.step_spread:
        return central
    tail = ServedMetrics.of(simulate(workload, server, block_size, seed=seed), workload)
    return replace(central, ttft_p99_s=tail.ttft_p99_s, tpot_p99_s=tail.tpot_p99_s)


def prediction_method(server: StepCostModel, seed: int = 0) -> str:
    """How `predict` prices the steps of `server`, in words."""
    if not server.step_spread:
        return "every step at its fitted time"
    return (
        "tokens/s, p50s, peak KV and preemptions at the fitted step times; p99s with "
        "the steps scaled by factors drawn from the calibration's step spread, each held "
        f"for {SPREAD_HOLD_S:g} s (seed {seed})"
    )


def mean_of(runs: tuple[ServedMetrics, ...]) -> ServedMetrics:
    """Each metric averaged over `runs`."""
    names = [f.name for f in fields(ServedMetrics)]
    return ServedMetrics(**{key: float(np.mean([getattr(r, key) for r in runs])) for key in names})
