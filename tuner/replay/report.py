"""The replay report as JSON (report.json) and as a fixed-width table.

The JSON object is ``{"trace": {...}, "policy": {...}, "goal", "goal_higher_is_better",
"warnings": [...], "results": [...], "timeline": [...], "fidelity"}``; each result has
exactly the keys of `RESULT_KEYS`, each timeline point ``t_s``, ``block_size`` and
``median_len``, and ``fidelity`` is the calibration's fidelity check
(`fidelity.fidelity.Fidelity.to_dict`) or null. Numbers that do not exist (a percentile of
nothing) are null.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from blocktune.tuner.config.defaults import DEFAULT_BLOCK_SIZE
from blocktune.tuner.config.jsonable import to_jsonable
from blocktune.tuner.config.text_table import text_table
from blocktune.tuner.replay.objective import OVERLOAD_SHARE
from blocktune.tuner.replay.runner import (
    ADAPTIVE,
    ORACLE,
    TOKENS_PER_S,
    ReplayReport,
    static_name,
)
from blocktune.tuner.sim.forecast import CHALLENGER_TOLERANCE, goal_higher_is_better
from blocktune.tuner.sim.served import ServedMetrics

__all__ = [
    "RESULT_KEYS",
    "comparisons",
    "goal_ratio",
    "goal_statement",
    "format_replay_table",
    "report_dict",
    "write_json",
]

RESULT_KEYS = (
    "policy",
    "block_size",
    "tokens_per_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "tpot_p99_s",
    "e2e_p99_s",
    "peak_kv_bytes",
    "mean_kv_bytes",
    "padding_ratio",
    "preemptions",
    "swaps",
    "goal_value",
    "objective",
    "replay_s",
)


def format_bytes(value: float) -> str:
    """Bytes in binary units with one decimal ("1.5 GiB")."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def report_dict(report: ReplayReport) -> dict:
    """The report as plain JSON types (see the module docstring)."""
    return to_jsonable(
        {
            "trace": report.trace,
            "policy": report.policy,
            "goal": report.policy["goal"],
            "goal_higher_is_better": goal_higher_is_better(report.policy["goal"]),
            "warnings": report.warnings,
            "results": [
                {key: getattr(result, key) for key in RESULT_KEYS} for result in report.results
            ],
            "timeline": [
                {"t_s": p.t_s, "block_size": p.block_size, "median_len": p.median_len}
                for p in report.timeline
            ],
            "fidelity": report.fidelity,
        }
    )


def write_json(report: ReplayReport, path: Path) -> None:
    """Write `report_dict(report)` to `path` (indented, strict JSON)."""
    path.write_text(json.dumps(report_dict(report), indent=2, allow_nan=False) + "\n")


def goal_ratio(goal: str, value: float, reference: float) -> float:
    """`value` against `reference` on `goal`, so that above 1 is better whichever way it points."""
    if goal_higher_is_better(goal):
        return value / reference if reference > 0 else math.nan
    return reference / value if value > 0 else math.nan


def comparisons(report: ReplayReport) -> dict[str, float]:
    """The adaptive policy on the goal (above 1: better) against the best static size, the
    oracle and static-16 (when 16 is a candidate), and on the per-token cost against them:
    ``adaptive_vs_best_static_goal``, ``adaptive_vs_oracle_goal``,
    ``adaptive_vs_static16_goal``, ``static_spread_goal`` (best over worst static size),
    ``adaptive_vs_oracle_objective``, ``adaptive_vs_static16_objective``,
    ``adaptive_vs_static16_peak_kv`` and ``adaptive_vs_static16_tokens_per_s``. Where every
    static goodput is 0, or every one is that of an overloaded server, the ``*_goal`` ratios
    compare tokens/s instead (`ReplayReport.compared_on`)."""
    goal = report.policy["goal"]
    if report.compared_on == TOKENS_PER_S:
        goal = "capacity"

        def value(r):
            return r.tokens_per_s
    else:

        def value(r):
            return r.goal_value

    adaptive, oracle = report.result(ADAPTIVE), report.result(ORACLE)
    statics = [r for r in report.results if r.block_size is not None]
    ranked = sorted(statics, key=lambda r: goal_ratio(goal, value(r), value(statics[0])))
    ratios = {
        "adaptive_vs_best_static_goal": goal_ratio(goal, value(adaptive), value(ranked[-1])),
        "adaptive_vs_oracle_goal": goal_ratio(goal, value(adaptive), value(oracle)),
        "static_spread_goal": goal_ratio(goal, value(ranked[-1]), value(ranked[0])),
        "adaptive_vs_oracle_objective": adaptive.objective / oracle.objective,
    }
    name = static_name(DEFAULT_BLOCK_SIZE)
    if any(r.policy == name for r in statics):
        static = report.result(name)
        ratios["adaptive_vs_static16_goal"] = goal_ratio(goal, value(adaptive), value(static))
        ratios["adaptive_vs_static16_objective"] = adaptive.objective / static.objective
        ratios["adaptive_vs_static16_peak_kv"] = adaptive.peak_kv_bytes / static.peak_kv_bytes
        ratios["adaptive_vs_static16_tokens_per_s"] = adaptive.tokens_per_s / static.tokens_per_s
    return ratios


GOAL_COLUMNS = {"capacity": ("goodput", "req/s", 3), "ttft_p99": ("goal TTFT", "s", 3)}
"""The table column of each goal: title, unit and decimals (capacity is scored as goodput)."""


def _columns(goal: str) -> tuple:
    title, unit, decimals = GOAL_COLUMNS[goal]
    return (
        # title, unit, value; every column is as wide as its widest cell
        ("policy", "", lambda r: r.policy),
        ("B", "tokens", lambda r: "-" if r.block_size is None else str(r.block_size)),
        (title, unit, lambda r: f"{r.goal_value:.{decimals}f}"),
        *ServedMetrics.columns(lambda r: r),
        ("e2e p99", "s", lambda r: f"{r.e2e_p99_s:.2f}"),
        ("peak KV", "", lambda r: format_bytes(r.peak_kv_bytes)),
        ("mean KV", "", lambda r: format_bytes(r.mean_kv_bytes)),
        ("padding", "", lambda r: f"{r.padding_ratio:.1%}"),
        ("preempt", "", lambda r: str(r.preemptions)),
        ("swaps", "", lambda r: str(r.swaps)),
        ("objective", "us/tok", lambda r: f"{r.objective * 1e6:.3f}"),
        ("replay", "s", lambda r: f"{r.replay_s:.2f}"),
    )


def goal_statement(report: ReplayReport) -> str:
    """What the goal column measures, in words."""
    policy = report.policy
    slo = policy["slo"]
    if policy["goal"] == "capacity":
        return (
            "goal: capacity, scored in a replay as SLO goodput (requests/s with TTFT <= "
            f"{slo['ttft_p99_s']:g} s and TPOT <= {slo['tpot_p99_s'] * 1e3:g} ms)"
        )
    return "goal: ttft_p99, the TTFT p99 of the replay (lower is better)"


def format_replay_table(report: ReplayReport) -> str:
    """One row per policy, then the goal, the comparisons and the verdict in words."""
    columns = _columns(report.policy["goal"])
    rows = [[title for title, _, _ in columns], [unit for _, unit, _ in columns]]
    rows += [[value(result) for _, _, value in columns] for result in report.results]
    lines = text_table(rows)
    ratios = comparisons(report)
    lines.append(goal_statement(report))
    on = "the goal"
    if report.compared_on == TOKENS_PER_S:
        on = "tokens/s"
        lines.append(
            "overloaded at every block size (a static size serves no request within the SLO, "
            f"or none serves {OVERLOAD_SHARE:.0%} of them): the policies are compared on "
            "tokens/s, what each still serves"
        )
    line = (
        f"adaptive on {on}: {ratios['adaptive_vs_best_static_goal']:.4f} x the best static "
        f"size, {ratios['adaptive_vs_oracle_goal']:.4f} x the oracle"
    )
    if "adaptive_vs_static16_goal" in ratios:
        line += f", {ratios['adaptive_vs_static16_goal']:.4f} x static-16"
    lines.append(line + " (above 1: better)")
    lines.append(
        "oracle: the best static size of each interval on the goal, in hindsight, swapped for "
        "free; never below the best static size (where following the intervals scores less, "
        "it is the best static size)"
    )
    swaps = report.result(ADAPTIVE).swaps
    lines.append(
        f"adaptive: {swaps} switch{'' if swaps == 1 else 'es'} (each needs a forecast gain "
        f"beyond the forecast's noise and min_gain, or {CHALLENGER_TOLERANCE:.1%} at the edge "
        f"of the SLO, at most one per min_dwell of {report.policy['min_dwell_s']:g} s)"
    )
    spread = ratios["static_spread_goal"] - 1
    if spread < report.policy["min_gain"]:
        lines.append(
            f"every static size is within {spread:.1%} of the best on {on}: the block size "
            "does not matter for this trace at this load"
        )
    else:
        lines.append(f"the best static size beats the worst by {spread:.1%} on {on}")
    if "adaptive_vs_static16_objective" in ratios:
        peak = ratios["adaptive_vs_static16_peak_kv"] - 1
        lines.append(
            f"adaptive / static-16: per-token cost {ratios['adaptive_vs_static16_objective']:.4f}, "
            f"tokens/s {ratios['adaptive_vs_static16_tokens_per_s']:.4f}, "
            f"peak KV {peak:+.1%} (the source article claims -19% peak memory)"
        )
    return "\n".join(lines)
