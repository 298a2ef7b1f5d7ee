"""A sweep's table: one row per trace x policy x setting x replayed policy, and its summary.

The columns are `RESULT_COLUMNS`: the point (``trace``, ``policy`` as the
spec names it, ``setting``), ``replay_policy`` (``static-16``, ``adaptive``,
``oracle``), the result keys of report.json (`RESULT_KEYS`, whose ``policy``
is ``replay_policy`` here), the policy's ``goal`` and ``warnings``: what
loading the trace and replaying it noticed. `summary_table` gives, per trace
and policy, the best setting and static block size on the goal, how much the
block size matters there, and the adaptive policy against that size.
"""

from __future__ import annotations

import pandas as pd

from blocktune.tuner.replay.report import RESULT_KEYS, goal_ratio, report_dict
from blocktune.tuner.replay.runner import ADAPTIVE, ReplayReport
from blocktune.tuner.sim.forecast import goal_higher_is_better

__all__ = ["POINT_COLUMNS", "RESULT_COLUMNS", "summary_table", "sweep_rows"]

POINT_COLUMNS = ("trace", "policy", "setting")
RESULT_COLUMNS = (
    *POINT_COLUMNS,
    "replay_policy",
    *(key for key in RESULT_KEYS if key != "policy"),
    "goal",
    "warnings",
)


def sweep_rows(report: ReplayReport, point: dict[str, str], warnings: list[str]) -> list[dict]:
    """The rows of one point's replay (`point` holds its `POINT_COLUMNS`), with the trace's
    loader `warnings` and the replay's."""
    as_json = report_dict(report)
    noticed = [*warnings, *as_json["warnings"]]
    rows = []
    for result in as_json["results"]:
        replayed = result.pop("policy")
        row = {**point, "replay_policy": replayed, **result}
        rows.append({**row, "goal": as_json["goal"], "warnings": noticed})
    return rows


def summary_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Per trace and policy: the setting and static size best on the goal and its goal value;
    at that setting, how much the best static size beats the worst (``spread``: near 0, the
    block size does not matter) and the adaptive policy's goal value over the best's (above
    1: better)."""
    static = rows[rows.replay_policy.str.startswith("static-")]
    adaptive = rows[rows.replay_policy == ADAPTIVE].set_index(list(POINT_COLUMNS)).goal_value
    lines = []
    for (trace, policy), group in static.groupby(["trace", "policy"], sort=False):
        goal = group.goal.iloc[0]
        values = group.goal_value.astype(float)
        best = group.loc[values.idxmax() if goal_higher_is_better(goal) else values.idxmin()]
        there = group[group.setting == best.setting].goal_value.astype(float)
        worst = there.min() if goal_higher_is_better(goal) else there.max()
        versus = adaptive.get((trace, policy, best.setting), float("nan"))
        lines.append(
            {
                "trace": trace,
                "policy": policy,
                "goal": goal,
                "best setting": best.setting,
                "B": best.block_size,
                "goal value": round(float(best.goal_value), 4),
                "spread": f"{goal_ratio(goal, best.goal_value, worst) - 1:.2%}",
                "adaptive / best": round(goal_ratio(goal, versus, best.goal_value), 4),
            }
        )
    return pd.DataFrame(lines)
