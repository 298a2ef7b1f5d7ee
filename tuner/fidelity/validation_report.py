"""The fidelity check as a fixed-width table and as JSON.

The JSON object is ``{"trace", "setup", "results", "rankings",
"median_abs_error", "median_calibration_noise"}``. The trace has ``requests``,
``too_long`` (those left out), ``token_limit`` (the most tokens a request kept holds)
and ``token_limit_of`` (what sets it: the model's positions or the KV pool). Each
result has ``block_size``, ``predicted`` and ``measured`` (the mean of the live
runs), each with the keys of `METRICS`, plus ``measured_runs``, ``relative_error``,
``noise`` and ``calibration_noise`` (the relative standard deviation of the
predictions with the calibration's refits) per metric.
``rankings`` has per metric of `RANK_METRICS` both orders (``predicted``,
``measured``, best first), ``compared_pairs`` (pairs beyond the noise),
``agreeing_pairs``, ``predicted_ties`` (compared pairs the prediction prices
alike) and ``agreement`` (null when no pair was compared). Each
result also has ``step_sensitivity``: ``tpot_p50_change`` (the predicted TPOT
p50's relative change with every step `SENSITIVITY_SCALE` times as long) and
``matching_step_scale`` (the step-time scale at which the predicted TPOT p50 is
the measured one). Numbers that do not exist (an error against nothing) are
null.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path

from blocktune.tuner.config.jsonable import to_jsonable
from blocktune.tuner.fidelity.served_metrics import METRICS, compared
from blocktune.tuner.fidelity.validation import (
    MATCHING_SCALE_RANGE,
    SENSITIVITY_SCALE,
    Ranking,
    Validation,
)

__all__ = [
    "GOAL_METRICS",
    "format_left_out",
    "format_median_errors",
    "format_ranking",
    "format_sensitivity",
    "format_validation_table",
    "metric_title",
    "validation_dict",
    "write_validation",
]

GOAL_METRICS = ("tokens_per_s", "tpot_p50_s", "ttft_p99_s")
"""The metrics whose median error the summary line reports."""

_HEADINGS = {
    "tokens_per_s": ("tok/s", "", 1.0, "{:.1f}"),
    "ttft_p50_s": ("TTFT p50", "ms", 1e3, "{:.2f}"),
    "ttft_p99_s": ("TTFT p99", "ms", 1e3, "{:.2f}"),
    "tpot_p50_s": ("TPOT p50", "ms", 1e3, "{:.3f}"),
    "tpot_p99_s": ("TPOT p99", "ms", 1e3, "{:.3f}"),
    "peak_kv_blocks": ("peak KV", "blocks", 1.0, "{:.1f}"),
    "preemptions": ("preempt", "", 1.0, "{:.1f}"),
}


def format_left_out(trace: Mapping) -> str | None:
    """The line on the requests a check left out as too long, with the limit and what sets
    it (`validation.left_out`); None where it left out none."""
    count = trace["too_long"]
    if not count:
        return None
    requests = "request" if count == 1 else "requests"
    return (
        f"left out {count} {requests} longer than {trace['token_limit']} tokens "
        f"({trace['token_limit_of']})"
    )


def validation_dict(validation: Validation) -> dict:
    """The check as plain JSON types (see the module docstring)."""
    results = [
        {
            "block_size": c.block_size,
            "predicted": compared(c.predicted),
            "measured": compared(c.measured),
            "measured_runs": [compared(r) for r in c.measured_runs],
            "relative_error": {m: c.error(m) for m in METRICS},
            "noise": {m: c.noise(m) for m in METRICS},
            "calibration_noise": {m: c.calibration_noise(m) for m in METRICS},
            "step_sensitivity": None if c.sensitivity is None else asdict(c.sensitivity),
        }
        for c in validation.checks
    ]
    return to_jsonable(
        {
            "trace": validation.trace,
            "setup": validation.setup,
            "results": results,
            "rankings": {
                r.metric: {
                    "predicted": r.predicted,
                    "measured": r.measured,
                    "compared_pairs": r.compared,
                    "agreeing_pairs": r.agreeing,
                    "predicted_ties": r.predicted_ties,
                    "agreement": r.agreement,
                }
                for r in validation.rankings
            },
            "median_abs_error": {m: validation.median_abs_error(m) for m in METRICS},
            "median_calibration_noise": {
                m: validation.median_calibration_noise(m) for m in METRICS
            },
        }
    )


def write_validation(validation: Validation, path: Path) -> None:
    """Write `validation_dict(validation)` to `path` (indented, strict JSON)."""
    text = json.dumps(validation_dict(validation), indent=2, allow_nan=False)
    path.write_text(text + "\n", encoding="utf-8")


def _percent(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:+.1%}"


def format_validation_table(validation: Validation) -> str:
    """Per block size: predicted, measured, relative error, (with 2+ runs) noise and (with
    the calibration's refits) its noise rows; then both rankings and the median errors of
    `GOAL_METRICS` (and the calibration's median noise on them)."""
    widths = [max(9, len(_HEADINGS[m][0]) + 1) for m in METRICS]
    lines = [
        f"{'B':>4}  {'':<9}"
        + "".join(f"{_HEADINGS[m][0]:>{w}}" for m, w in zip(METRICS, widths, strict=True)),
        f"{'':>4}  {'':<9}"
        + "".join(f"{_HEADINGS[m][1]:>{w}}" for m, w in zip(METRICS, widths, strict=True)),
    ]
    for check in validation.checks:
        rows = [
            ("predicted", [_value(m, getattr(check.predicted, m)) for m in METRICS]),
            ("measured", [_value(m, getattr(check.measured, m)) for m in METRICS]),
            ("error", [_percent(check.error(m)) for m in METRICS]),
        ]
        if len(check.measured_runs) > 1:
            rows.append(("noise", [_percent(check.noise(m)).lstrip("+") for m in METRICS]))
        if check.predicted_draws:
            rows.append(
                ("calib SD", [_percent(check.calibration_noise(m)).lstrip("+") for m in METRICS])
            )
        for i, (label, cells) in enumerate(rows):
            size = str(check.block_size) if i == 0 else ""
            lines.append(
                f"{size:>4}  {label:<9}"
                + "".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True))
            )
    if "prediction" in validation.setup:
        lines.append(f"predicted: {validation.setup['prediction']}")
    lines += format_sensitivity(validation)
    one_run = max(len(c.measured_runs) for c in validation.checks) < 2
    lines += [format_ranking(r, one_run=one_run) for r in validation.rankings]
    medians = {m: validation.median_abs_error(m) for m in GOAL_METRICS}
    lines.append(f"median |error| over block sizes: {format_median_errors(medians)}")
    noises = {m: validation.median_calibration_noise(m) for m in GOAL_METRICS}
    if not all(math.isnan(v) for v in noises.values()):
        lines.append(
            "the calibration's own noise (calib SD: the predictions' standard deviation over "
            f"{validation.setup['calibration_draws']} refits on resampled timing moments), "
            f"median over block sizes: {format_median_errors(noises)}"
        )
    return "\n".join(lines)


def format_sensitivity(validation: Validation) -> list[str]:
    """Two lines on the step time (see `validation.StepSensitivity`), none without it."""
    checks = [c for c in validation.checks if c.sensitivity is not None]
    if not checks:
        return []
    changes = ", ".join(
        f"{_percent(c.sensitivity.tpot_p50_change)} (B={c.block_size})" for c in checks
    )
    low, high = MATCHING_SCALE_RANGE

    def scale_text(scale: float | None) -> str:
        return f"none in {low:g}-{high:g}x" if scale is None else f"{scale:.2f}x"

    scales = ", ".join(
        f"{scale_text(c.sensitivity.matching_step_scale)} (B={c.block_size})" for c in checks
    )
    return [
        f"steps {SENSITIVITY_SCALE - 1:.0%} longer move the predicted TPOT p50 by {changes}",
        f"the step-time scale at which the predicted TPOT p50 is the measured one: {scales}",
    ]


def format_median_errors(medians: Mapping[str, float | None]) -> str:
    """The `GOAL_METRICS` medians of a check as text: "tok/s 2.5%, TPOT p50 3.5%, ..." (a
    missing or NaN median as "-")."""
    cells = []
    for metric in GOAL_METRICS:
        value = medians.get(metric)
        shown = "-" if value is None or math.isnan(value) else f"{value:.1%}"
        cells.append(f"{metric_title(metric)} {shown}")
    return ", ".join(cells)


def metric_title(metric: str) -> str:
    """How tables and summaries name a metric of `METRICS` ("TPOT p50")."""
    return _HEADINGS[metric][0]


def _value(metric: str, value: float) -> str:
    _, _, scale, fmt = _HEADINGS[metric]
    return "-" if math.isnan(value) else fmt.format(value * scale)


def format_ranking(ranking: Ranking, *, one_run: bool = False) -> str:
    """One line: both orders by the ranking's metric and how many pairs beyond the noise
    agree, or that no pair differs beyond it (then no agreement is claimed)."""
    name = _HEADINGS[ranking.metric][0]
    predicted = ranking.predicted_text or " ".join(map(str, ranking.predicted))
    measured = ranking.measured_text or " ".join(map(str, ranking.measured))
    beyond = (
        "by more than 1% (one live run each: no noise measured)"
        if one_run
        else ("beyond the run-to-run noise")
    )
    if ranking.compared:
        verdict = f"{ranking.agreeing} of {ranking.compared} pair(s) {beyond} ordered alike"
        if ranking.predicted_ties:
            verdict += (
                f" ({ranking.predicted_ties} of them predicted equal: the calibration prices "
                "those sizes alike, the live runs set them apart)"
            )
    else:
        verdict = f"no pair compared: no two block sizes differ {beyond}"
    return f"ranking by {name}, best first: predicted {predicted}, measured {measured}: {verdict}"
