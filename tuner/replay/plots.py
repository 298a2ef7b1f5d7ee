"""PNG plots of a replay report, drawn with matplotlib's Agg canvas (no display, no pyplot).

- ``lengths_over_time.png``: requests per (arrival time, prompt + output
  length) cell, lengths on a log scale;
- ``adaptive_timeline.png``: the adaptive block size over time beside the
  oracle's, above the request rate and the median length the window saw;
- ``policies.png``: padding ratio and peak KV bytes of every policy.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from blocktune.tuner.replay.runner import ReplayReport

__all__ = [
    "PLOT_FILES",
    "agg_figure",
    "plot_adaptive_timeline",
    "plot_lengths",
    "plot_policies",
    "write_plots",
]

PLOT_FILES = ("lengths_over_time.png", "adaptive_timeline.png", "policies.png")
_DPI = 110


def _time_unit(span_s: float) -> tuple[float, str]:
    """Seconds per unit and its name, so a trace's span reads naturally."""
    if span_s >= 3 * 3600:
        return 3600.0, "h"
    if span_s >= 3 * 60:
        return 60.0, "min"
    return 1.0, "s"


def agg_figure(height: float = 4.0) -> Figure:
    """A 9-inch-wide figure on an Agg canvas, laid out by matplotlib's constrained layout."""
    figure = Figure(figsize=(9, height), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def plot_lengths(report: ReplayReport) -> Figure:
    """Heat map of requests by arrival time and prompt + output tokens."""
    workload = report.workload
    scale, unit = _time_unit(float(workload.arrival_s[-1]))
    totals = workload.total_tokens
    figure = agg_figure()
    axes = figure.add_subplot()
    time_bins = np.linspace(0, workload.arrival_s[-1] / scale, 97)
    length_bins = np.logspace(np.log2(totals.min()), np.log2(totals.max() + 1), 49, base=2.0)
    counts, x, y = np.histogram2d(workload.arrival_s / scale, totals, [time_bins, length_bins])
    mesh = axes.pcolormesh(x, y, np.ma.masked_equal(counts.T, 0), cmap="viridis")
    axes.set_yscale("log", base=2)
    axes.set_xlabel(f"arrival time [{unit}]")
    axes.set_ylabel("prompt + output [tokens]")
    axes.set_title(f"request lengths over time: {report.trace['label']}")
    figure.colorbar(mesh, ax=axes, label="requests")
    return figure


def plot_adaptive_timeline(report: ReplayReport) -> Figure:
    """Adaptive and oracle block sizes over time; request rate and median length below."""
    workload, interval = report.workload, report.interval_s
    span = max(float(workload.arrival_s[-1]), interval)
    scale, unit = _time_unit(span)
    figure = agg_figure(5.5)
    sizes, rates = figure.subplots(2, 1, sharex=True, height_ratios=(1, 1))
    starts = np.arange(len(report.oracle_schedule)) * interval / scale
    sizes.step(starts, report.oracle_schedule, where="post", ls="--", c="grey", label="oracle")
    initial = report.policy["initial_block_size"]
    times = np.array([0.0] + [p.t_s / scale for p in report.timeline])
    chosen = np.array([initial] + [p.block_size for p in report.timeline])
    sizes.step(times, chosen, where="post", c="C0", lw=2, label="adaptive")
    sizes.set_yscale("log", base=2)
    sizes.set_ylabel("block size [tokens]")
    sizes.legend(loc="upper left")
    sizes.set_title(f"adaptive block size: {report.trace['label']}")
    counts = np.bincount(workload.interval_index(interval))
    rates.step(starts[: len(counts)], counts / interval, where="post", c="C1")
    rates.set_ylabel("requests/s", color="C1")
    rates.set_xlabel(f"trace time [{unit}]")
    median = rates.twinx()
    points = [p for p in report.timeline if p.median_len is not None]
    median.plot([p.t_s / scale for p in points], [p.median_len for p in points], c="C2")
    median.set_ylabel("window median length [tokens]", color="C2")
    return figure


def plot_policies(report: ReplayReport) -> Figure:
    """Padding ratio and peak KV bytes, one bar per policy."""
    names = [r.policy for r in report.results]
    figure = agg_figure()
    padding, peak = figure.subplots(1, 2)
    padding.bar(names, [100 * r.padding_ratio for r in report.results], color="C0")
    padding.set_ylabel("padding [% of allocated KV slots]")
    gib = max(r.peak_kv_bytes for r in report.results) >= 2**30
    unit, scale = ("GiB", 2**30) if gib else ("MiB", 2**20)
    peak.bar(names, [r.peak_kv_bytes / scale for r in report.results], color="C1")
    peak.set_ylabel(f"peak KV [{unit}]")
    for axes in (padding, peak):
        axes.tick_params(axis="x", labelrotation=45)
    figure.suptitle(f"padding and peak KV per policy: {report.trace['label']}")
    return figure


def write_plots(report: ReplayReport, folder: Path) -> list[Path]:
    """Write the three PNGs (`PLOT_FILES`) into `folder`; returns their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, plot in zip(
        PLOT_FILES, (plot_lengths, plot_adaptive_timeline, plot_policies), strict=True
    ):
        path = folder / name
        plot(report).savefig(path)
        paths.append(path)
    return paths
