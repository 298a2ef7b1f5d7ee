"""The replay report as JSON (report.json) and as a fixed-width table.

The JSON object is ``{"trace": {...}, "policy": {...}, "results": [...],
"timeline": [...]}``; each result has exactly the keys of `RESULT_KEYS` and
each timeline point ``t_s``, ``block_size`` and ``median_len``. Numbers that
do not exist (a percentile of nothing) are null.
"""

from __future__ import annotations

import json
from pathlib import Path

from blocktune.tuner.core.defaults import DEFAULT_BLOCK_SIZE
from blocktune.tuner.core.jsonable import to_jsonable
from blocktune.tuner.replay.runner import ADAPTIVE, ORACLE, ReplayReport, static_name

__all__ = [
    "RESULT_KEYS",
    "comparisons",
    "format_replay_table",
    "replay_warnings",
    "report_dict",
    "write_json",
]

RESULT_KEYS = (
    "policy",
    "block_size",
    "tokens_per_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p99_s",
    "e2e_p99_s",
    "peak_kv_bytes",
    "mean_kv_bytes",
    "padding_ratio",
    "preemptions",
    "swaps",
    "objective",
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
            "results": [
                {key: getattr(result, key) for key in RESULT_KEYS} for result in report.results
            ],
            "timeline": [
                {"t_s": p.t_s, "block_size": p.block_size, "median_len": p.median_len}
                for p in report.timeline
            ],
        }
    )


def write_json(report: ReplayReport, path: Path) -> None:
    """Write `report_dict(report)` to `path` (indented, strict JSON)."""
    path.write_text(json.dumps(report_dict(report), indent=2, allow_nan=False) + "\n")


def replay_warnings(report: ReplayReport) -> list[str]:
    """What a reader of the replay's figures should know, one line each."""
    left_out = report.trace["too_long_for_the_pool"]
    if not left_out:
        return []
    return [f"left out {left_out} requests longer than the KV pool"]


def comparisons(report: ReplayReport) -> dict[str, float]:
    """Ratios of the adaptive policy to the oracle and to static-16 (when 16 is a candidate):
    ``adaptive_vs_oracle_objective``, ``adaptive_vs_static16_objective``,
    ``adaptive_vs_static16_peak_kv`` and ``adaptive_vs_static16_tokens_per_s``."""
    adaptive = report.result(ADAPTIVE)
    ratios = {"adaptive_vs_oracle_objective": adaptive.objective / report.result(ORACLE).objective}
    name = static_name(DEFAULT_BLOCK_SIZE)
    if any(r.policy == name for r in report.results):
        static = report.result(name)
        ratios["adaptive_vs_static16_objective"] = adaptive.objective / static.objective
        ratios["adaptive_vs_static16_peak_kv"] = adaptive.peak_kv_bytes / static.peak_kv_bytes
        ratios["adaptive_vs_static16_tokens_per_s"] = adaptive.tokens_per_s / static.tokens_per_s
    return ratios


_COLUMNS = (
    # title, unit, value; every column is as wide as its widest cell
    ("policy", "", lambda r: r.policy),
    ("B", "tokens", lambda r: "-" if r.block_size is None else str(r.block_size)),
    ("tok/s", "", lambda r: f"{r.tokens_per_s:.1f}"),
    ("TTFT p50", "s", lambda r: f"{r.ttft_p50_s:.3f}"),
    ("TTFT p99", "s", lambda r: f"{r.ttft_p99_s:.3f}"),
    ("TPOT p50", "ms", lambda r: f"{r.tpot_p50_s * 1e3:.1f}"),
    ("TPOT p99", "ms", lambda r: f"{r.tpot_p99_s * 1e3:.1f}"),
    ("e2e p99", "s", lambda r: f"{r.e2e_p99_s:.2f}"),
    ("peak KV", "", lambda r: format_bytes(r.peak_kv_bytes)),
    ("mean KV", "", lambda r: format_bytes(r.mean_kv_bytes)),
    ("padding", "", lambda r: f"{r.padding_ratio:.1%}"),
    ("preempt", "", lambda r: str(r.preemptions)),
    ("swaps", "", lambda r: str(r.swaps)),
    ("objective", "us/tok", lambda r: f"{r.objective * 1e6:.3f}"),
    ("replay", "s", lambda r: f"{r.replay_s:.2f}"),
)


def format_replay_table(report: ReplayReport) -> str:
    """One row per policy, then the adaptive-vs-oracle and adaptive-vs-static-16 ratios."""
    rows = [[title for title, _, _ in _COLUMNS], [unit for _, unit, _ in _COLUMNS]]
    rows += [[value(result) for _, _, value in _COLUMNS] for result in report.results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = []
    for first, *cells in rows:
        right = "".join(f"  {c:>{w}}" for c, w in zip(cells, widths[1:], strict=True))
        lines.append(f"{first:<{widths[0]}}{right}")
    ratios = comparisons(report)
    lines.append(
        f"adaptive / oracle objective: {ratios['adaptive_vs_oracle_objective']:.4f} "
        "(the oracle is a lower bound: 1 is the best a tuner can do)"
    )
    if "adaptive_vs_static16_objective" in ratios:
        peak = ratios["adaptive_vs_static16_peak_kv"] - 1
        lines.append(
            f"adaptive / static-16: objective {ratios['adaptive_vs_static16_objective']:.4f}, "
            f"tokens/s {ratios['adaptive_vs_static16_tokens_per_s']:.4f}, "
            f"peak KV {peak:+.1%} (the source article claims -19% peak memory)"
        )
    return "\n".join(lines)
