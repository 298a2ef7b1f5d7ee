"""A calibration's fidelity check (`blocktune validate --json`), attached to a replay.

`blocktune replay --validation FILE` reads the JSON that `blocktune validate`
wrote for the calibration the replay uses: how far the simulator's predictions
were from the live engine, per block size and as the median over them, and
per ranking metric how many pairs of block sizes both ordered alike. The replay report carries it
(`fidelity` in report.json, a line under the table), and warns where a median
error is above `FIDELITY_GOALS`, where the rankings disagreed, or where the
check was made with another calibration than the replay's.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

from blocktune.tuner.config.config_files import load_yaml_model
from blocktune.tuner.fidelity.validation_report import format_median_errors, metric_title

__all__ = ["FIDELITY_GOALS", "Fidelity", "load_fidelity"]

FIDELITY_GOALS = {"tokens_per_s": 0.10, "tpot_p50_s": 0.10, "ttft_p99_s": 0.25}
"""Median |relative error| over the block sizes above which a replay warns, per metric."""


class _Read(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class _Trace(_Read):
    label: str


class _Setup(_Read):
    calibration: str


class _Result(_Read):
    block_size: int
    relative_error: dict[str, float | None]


class _Ranking(_Read):
    compared_pairs: int
    agreeing_pairs: int
    agreement: bool | None


class Fidelity(_Read):
    """The parts of a `blocktune validate --json` file that a replay reports."""

    trace: _Trace
    setup: _Setup
    rankings: dict[str, _Ranking]
    median_abs_error: dict[str, float | None]
    results: list[_Result]

    def summary(self) -> str:
        """One line: the check's trace, its median errors and, per ranking metric, how many
        pairs beyond the noise were ordered alike (or that none was compared)."""
        errors = format_median_errors(self.median_abs_error)
        ranks = []
        for metric, r in self.rankings.items():
            shown = (
                f"{r.agreeing_pairs} of {r.compared_pairs} pairs alike"
                if r.compared_pairs
                else "no pair beyond the noise"
            )
            ranks.append(f"{metric_title(metric)} {shown}")
        return (
            f"fidelity (blocktune validate on {self.trace.label}): median |error| over the "
            f"block sizes {errors}; rankings: {', '.join(ranks)}"
        )

    def warnings(self, calibration: str) -> list[str]:
        """What a reader of a replay priced by `calibration` (its description) must know."""
        out = []
        if self.setup.calibration != calibration:
            out.append(
                f"the fidelity check was made with another calibration ({self.setup.calibration})"
                f" than this replay's ({calibration}): it does not describe these predictions"
            )
        for metric, goal in FIDELITY_GOALS.items():
            error = self.median_abs_error.get(metric)
            if error is not None and error > goal:
                out.append(
                    f"the simulator missed the live engine by {error:.1%} on "
                    f"{metric_title(metric)} (median over the block sizes; aimed for under "
                    f"{goal:.0%}): read this replay's figures of it as estimates"
                )
        for metric, r in self.rankings.items():
            if r.agreement is False:
                out.append(
                    f"the simulator and the live engine ranked the block sizes differently by "
                    f"{metric_title(metric)} ({r.compared_pairs - r.agreeing_pairs} of "
                    f"{r.compared_pairs} pairs): the best size of this replay may not be the "
                    "engine's"
                )
        return out

    def to_dict(self) -> dict:
        """The report.json section: trace, calibration, rankings and errors per block size."""
        return {
            "trace": self.trace.label,
            "calibration": self.setup.calibration,
            "rankings": {m: r.model_dump() for m, r in self.rankings.items()},
            "median_abs_error": self.median_abs_error,
            "relative_error": {r.block_size: r.relative_error for r in self.results},
        }


def load_fidelity(path: Path | str) -> Fidelity:
    """Read a `blocktune validate --json` file; `ConfigError` names the file, line and key."""
    return load_yaml_model(path, Fidelity)
