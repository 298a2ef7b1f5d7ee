"""A sweep's table: one row per trace x policy x setting x replayed policy, and its summary.

The columns are `RESULT_COLUMNS`: the point (``trace``, ``policy`` as the
spec names it, ``setting``), ``replay_policy`` (``static-16``, ``adaptive``,
``oracle``), the result keys of report.json (`RESULT_KEYS`, whose ``policy``
is ``replay_policy`` here) and ``warnings``, what loading the trace and
replaying it noticed. `summary_table` gives, per trace and policy, the best
setting and static block size on the objective and the adaptive policy's
gain there.
"""

from __future__ import annotations

import pandas as pd

from blocktune.tuner.replay.report import RESULT_KEYS, replay_warnings, report_dict
from blocktune.tuner.replay.runner import ADAPTIVE, ReplayReport

__all__ = ["POINT_COLUMNS", "RESULT_COLUMNS", "summary_table", "sweep_rows"]

POINT_COLUMNS = ("trace", "policy", "setting")
RESULT_COLUMNS = (
    *POINT_COLUMNS,
    "replay_policy",
    *(key for key in RESULT_KEYS if key != "policy"),
    "warnings",
)


def sweep_rows(report: ReplayReport, point: dict[str, str], warnings: list[str]) -> list[dict]:
    """The rows of one point's replay (`point` holds its `POINT_COLUMNS`), with the trace's
    loader `warnings` and the replay's."""
    noticed = [*warnings, *replay_warnings(report)]
    rows = []
    for result in report_dict(report)["results"]:
        replayed = result.pop("policy")
        rows.append({**point, "replay_policy": replayed, **result, "warnings": noticed})
    return rows


def summary_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Per trace and policy: the setting and static size with the lowest objective, that
    objective in us per token, and how much lower the adaptive policy's is at that setting."""
    static = rows[rows.replay_policy.str.startswith("static-")]
    adaptive = rows[rows.replay_policy == ADAPTIVE].set_index(list(POINT_COLUMNS)).objective
    lines = []
    for (trace, policy), group in static.groupby(["trace", "policy"], sort=False):
        best = group.loc[group.objective.idxmin()]
        gain = 1 - adaptive.get((trace, policy, best.setting), float("nan")) / best.objective
        lines.append(
            {
                "trace": trace,
                "policy": policy,
                "best setting": best.setting,
                "B": best.block_size,
                "objective us/tok": round(best.objective * 1e6, 3),
                "adaptive gain": f"{gain:+.2%}",
            }
        )
    return pd.DataFrame(lines)
