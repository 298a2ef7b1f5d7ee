"""Run a sweep's points on a Dask cluster and collect their rows.

Each trace is loaded once, by one task, and its table moves to the workers
that plan a replay of it; each point (trace x policy x setting) is one
`submit_replay`, whose report becomes rows on the worker that assembles it,
so only rows come back. A point that fails (a budget whose pool no request
fits, a trace that cannot be read) is reported with the point; the others
are kept.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import pandas as pd
from distributed import Client

from blocktune.tuner.replay.inputs import TraceInput
from blocktune.tuner.sweep.executor import submit_replay, track
from blocktune.tuner.sweep.results import RESULT_COLUMNS, sweep_rows
from blocktune.tuner.sweep.spec import SweepPoint

__all__ = ["SweepFailure", "SweepResult", "run_sweep"]


@dataclass(frozen=True)
class SweepFailure:
    """A point whose replay failed, and the error, as ``TypeName: message``."""

    point: SweepPoint
    error: str


@dataclass(frozen=True)
class SweepResult:
    """The rows of every point that replayed (see `sweep_rows`) and the points that failed."""

    rows: pd.DataFrame
    failures: list[SweepFailure]


def run_sweep(client: Client, points: list[SweepPoint], *, progress: bool = True) -> SweepResult:
    """Replay every point on `client`'s cluster. Ctrl-C raises `KeyboardInterrupt`; closing
    the client then releases the tasks."""
    loads = {}
    for source in dict.fromkeys(point.source for point in points):
        loaded = client.submit(TraceInput.load, source)
        loads[source] = {
            part: client.submit(operator.attrgetter(part), loaded)
            for part in ("frame", "label", "warnings")
        }
    submitted, waited = [], []
    for point in points:
        trace = loads[point.source]
        replay = submit_replay(
            client,
            trace["frame"],
            point.policy,
            point.calibration,
            label=trace["label"],
            shards=point.shards,
        )
        named = {"trace": point.trace, "policy": point.policy_name, "setting": point.setting}
        rows = client.submit(sweep_rows, replay.report, named, trace["warnings"])
        submitted.append((point, rows))
        waited += [*replay.plays, rows]
    track(client, waited, desc="sweep", progress=progress)
    kept, failures = [], []
    for point, rows in submitted:
        if rows.status == "finished":
            kept += rows.result()
        else:
            error = rows.exception()
            failures.append(SweepFailure(point, f"{type(error).__name__}: {error}"))
    return SweepResult(pd.DataFrame(kept, columns=list(RESULT_COLUMNS)).convert_dtypes(), failures)
