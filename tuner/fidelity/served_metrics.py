"""The metrics a fidelity check compares for one run (simulated or live) of one block size.

Only numpy is imported at the top, so the command line can list `METRICS`
without loading the simulator.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from blocktune.tuner.sim.simulator import Run
    from blocktune.tuner.sim.step_cost import StepCostModel
    from blocktune.tuner.sim.workload import Workload

__all__ = ["HIGHER_IS_BETTER", "METRICS", "ServedMetrics"]

HIGHER_IS_BETTER = ("tokens_per_s",)
"""Metrics where more is better; for every other one less is."""


@dataclass(frozen=True)
class ServedMetrics:
    """Throughput, latency percentiles [s] and pool use of one run of one block size."""

    tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    peak_kv_blocks: float
    preemptions: float

    @classmethod
    def of(cls, workload: Workload, run: Run) -> ServedMetrics:
        """The metrics of `run` (simulated or live) on `workload`, its times as
        `ServingMetrics.of_times` computes them."""
        from blocktune.tuner.sim.forecast import ServingMetrics

        times = ServingMetrics.of_times(workload, run.first_token_s, run.finish_s, run.generated)
        return cls(
            **{key: getattr(times, key) for key in METRICS[:5]},
            peak_kv_blocks=float(run.peak_blocks),
            preemptions=float(run.preemptions),
        )

    @classmethod
    def predicted(
        cls, workload: Workload, server: StepCostModel, block_size: int, *, seed: int = 0
    ) -> ServedMetrics:
        """The simulator's prediction for `workload` at `block_size`: tokens/s, the p50s, the
        peak blocks and the preemptions of a run at the fitted step times, the p99s of a run
        whose steps are scaled by factors drawn from the calibration's step spread (`seed`;
        each held for a stretch of simulated time, `simulator.SPREAD_HOLD_S`); one run
        where the calibration has no spread.

        The spread is a distribution over all the grid's steps, so it widens the tails as
        the live steps do; but drawn at random it also moves which requests decode while a
        long prompt is computed, which the central figures of a saturated run follow (see
        docs/architecture.md)."""
        from dataclasses import replace

        from blocktune.tuner.sim.simulator import simulate

        central = cls.of(
            workload, simulate(workload, replace(server, sample_spread=False), block_size)
        )
        if not server.step_spread:
            return central
        tail = cls.of(workload, simulate(workload, server, block_size, seed=seed))
        return replace(central, ttft_p99_s=tail.ttft_p99_s, tpot_p99_s=tail.tpot_p99_s)

    @staticmethod
    def prediction_method(server: StepCostModel, seed: int = 0) -> str:
        """How `predicted` prices the steps of `server`, in words."""
        if not server.step_spread:
            return "every step at its fitted time"
        from blocktune.tuner.sim.simulator import SPREAD_HOLD_S

        return (
            "tokens/s, p50s, peak KV and preemptions at the fitted step times; p99s with "
            "the steps scaled by factors drawn from the calibration's step spread, each held "
            f"for {SPREAD_HOLD_S:g} s (seed {seed})"
        )

    @classmethod
    def mean(cls, runs: tuple[ServedMetrics, ...]) -> ServedMetrics:
        """Each metric averaged over `runs`."""
        return cls(**{key: float(np.mean([getattr(r, key) for r in runs])) for key in METRICS})


METRICS = tuple(f.name for f in fields(ServedMetrics))
"""The compared metrics, in table order."""
