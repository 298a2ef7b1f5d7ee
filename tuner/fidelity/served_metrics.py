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
    def mean(cls, runs: tuple[ServedMetrics, ...]) -> ServedMetrics:
        """Each metric averaged over `runs`."""
        return cls(**{key: float(np.mean([getattr(r, key) for r in runs])) for key in METRICS})


METRICS = tuple(f.name for f in fields(ServedMetrics))
"""The compared metrics, in table order."""
