"""PNG plots of a sweep: per trace, the objective of every replayed policy across the settings.

``objective-<n>.png`` is the n-th trace of the results: one panel per policy,
the settings along x in the order the sweep ran them (the grid's order), one
line per replayed policy (every static size, adaptive, oracle), the objective
in microseconds per generated token up the side.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from blocktune.tuner.replay.plots import agg_figure

__all__ = ["write_plots"]


def write_plots(rows: pd.DataFrame, folder: Path) -> list[Path]:
    """Write one ``objective-<n>.png`` per trace of `rows` into `folder`; returns their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for number, (trace, of_trace) in enumerate(rows.groupby("trace", sort=False), start=1):
        policies = of_trace.groupby("policy", sort=False)
        figure = agg_figure(4.5)
        panels = figure.subplots(1, len(policies), squeeze=False)[0]
        for axes, (policy, of_policy) in zip(panels, policies, strict=True):
            settings = list(dict.fromkeys(of_policy.setting))
            for replayed, line in of_policy.groupby("replay_policy", sort=False):
                line = line.set_index("setting").objective.reindex(settings)
                axes.plot(settings, line.to_numpy(dtype=float) * 1e6, marker="o", label=replayed)
            axes.set_title(str(policy))
            axes.set_yscale("log")
            axes.set_ylabel("objective [us per generated token]")
            axes.tick_params(axis="x", labelrotation=30)
        panels[-1].legend(fontsize="small")
        figure.suptitle(f"objective per setting: {trace}")
        path = folder / f"objective-{number}.png"
        figure.savefig(path)
        paths.append(path)
    return paths
