"""The metrics of one served run, simulated or live, as a user sees them.

Only numpy is imported at the top: the record loads without the simulator.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from blocktune.tuner.config.policy import SloSettings
    from blocktune.tuner.sim.simulator import Run
    from blocktune.tuner.sim.workload import Workload

__all__ = ["ServedMetrics", "percentiles"]


@dataclass(frozen=True)
class ServedMetrics:
    """One served run as a user sees it (seconds; KV bytes across all layers).

    TTFT runs from arrival to the first token, TPOT is the mean time between a
    request's later tokens, e2e from arrival to the last token; `tokens_per_s`
    counts generated tokens over the span from the first arrival to the last
    finish. The peak KV is held both in bytes and in blocks: a run that changes
    its block size peaks in bytes and in blocks at different moments. The counts
    are whole for one run and fractional for a mean over runs.
    """

    tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    e2e_p99_s: float
    peak_kv_bytes: float
    peak_kv_blocks: float
    preemptions: float

    @classmethod
    def of(cls, run: Run, workload: Workload) -> ServedMetrics:
        """The metrics of `run` (simulated, or live on a virtual clock) of `workload`."""
        return cls.of_times(
            workload,
            run.first_token_s,
            run.finish_s,
            run.generated,
            peak_kv_bytes=int(run.peak_kv_bytes),
            peak_kv_blocks=int(run.peak_blocks),
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
        peak_kv_bytes: float = 0,
        peak_kv_blocks: float = 0,
        preemptions: float = 0,
    ) -> ServedMetrics:
        """The metrics of a served workload from its per-row first-token and finish times
        and generated tokens (TPOT over requests of 2+ tokens)."""
        arrival, outputs = workload.arrival_s, workload.output_tokens
        later = outputs > 1
        tpot = (finish_s[later] - first_token_s[later]) / (outputs[later] - 1)
        span = float(np.max(finish_s)) - float(arrival[0])
        tpot_p50, tpot_p99 = percentiles(tpot, (50, 99)) if len(tpot) else (np.nan, np.nan)
        ttft_p50, ttft_p99 = percentiles(first_token_s - arrival, (50, 99))
        return cls(
            tokens_per_s=float(generated.sum()) / span if span > 0 else math.nan,
            ttft_p50_s=float(ttft_p50),
            ttft_p99_s=float(ttft_p99),
            tpot_p50_s=float(tpot_p50),
            tpot_p99_s=float(tpot_p99),
            e2e_p99_s=percentiles(finish_s - arrival, (99,))[0],
            peak_kv_bytes=peak_kv_bytes,
            peak_kv_blocks=peak_kv_blocks,
            preemptions=preemptions,
        )

    @staticmethod
    def columns(of: Callable[[Any], Any]) -> tuple:
        """`text_table` columns (title, unit, cell) of tokens/s and the TTFT and TPOT
        percentiles of the metrics `of(row)` gives (a `ServedMetrics` or alike)."""
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


def percentiles(values: np.ndarray, qs: tuple[float, ...]) -> list[float]:
    """`np.percentile(values, qs)` (its default, linear method) bit for bit, for the small
    arrays of one simulated run, where numpy's own call costs more than the sort: a
    forecast takes a few hundred of them. NaN wherever `values` holds one."""
    ordered = np.sort(values)
    last = len(ordered) - 1
    if last < 0:
        raise ValueError("percentiles of an empty array")
    if math.isnan(ordered[last]):
        return [math.nan] * len(qs)
    out = []
    for q in qs:
        index = (q / 100) * last
        low = math.floor(index)
        if low >= last:
            out.append(float(ordered[last]))
            continue
        gamma = index - low
        below, above = ordered[low], ordered[low + 1]
        diff = above - below
        # numpy's lerp: from the nearer end, so that gamma 1 gives `above` exactly
        out.append(float(above - diff * (1 - gamma) if gamma >= 0.5 else below + diff * gamma))
    return out
