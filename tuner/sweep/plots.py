"""PNG plots of a sweep: per trace, the goal value of every replayed policy across the settings.

``goal-<n>.png`` is the n-th trace of the results: one panel per policy, the
settings along x in the order the sweep ran them (the grid's order), one line
per replayed policy (every static size, adaptive, oracle), the value on the
policy's goal up the side (SLO goodput for ``capacity``, TTFT p99 for
``ttft_p99``).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from blocktune.tuner.replay.plots import agg_figure
from blocktune.tuner.replay.report import GOAL_COLUMNS
from blocktune.tuner.sim.forecast import goal_higher_is_better

__all__ = ["write_plots"]


def _goal_axis(goal: str) -> str:
    title, unit, _ = GOAL_COLUMNS[goal]
    better = "higher" if goal_higher_is_better(goal) else "lower"
    return f"{title} [{unit}] ({better} is better)"


def write_plots(rows: pd.DataFrame, folder: Path) -> list[Path]:
    """Write one ``goal-<n>.png`` per trace of `rows` into `folder`; returns their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for number, (trace, of_trace) in enumerate(rows.groupby("trace", sort=False), start=1):
        policies = of_trace.groupby("policy", sort=False)
        figure = agg_figure(4.5)
        panels = figure.subplots(1, len(policies), squeeze=False)[0]
        for axes, (policy, of_policy) in zip(panels, policies, strict=True):
            settings = list(dict.fromkeys(of_policy.setting))
            for replayed, line in of_policy.groupby("replay_policy", sort=False):
                line = line.set_index("setting").goal_value.reindex(settings)
                axes.plot(settings, line.to_numpy(dtype=float), marker="o", label=replayed)
            axes.set_title(str(policy))
            axes.set_ylabel(_goal_axis(of_policy.goal.iloc[0]))
            axes.tick_params(axis="x", labelrotation=30)
        panels[-1].legend(fontsize="small")
        figure.suptitle(f"goal value per setting: {trace}")
        path = folder / f"goal-{number}.png"
        figure.savefig(path)
        paths.append(path)
    return paths
