"""Load a request trace file into the canonical table (see `blocktune.traces.schema`).

`load_trace` picks the format (or recognises it with ``fmt="auto"`` from the
header and the extension), streams the file in chunks keeping only the needed
columns, skips and counts bad rows (or, with ``strict``, stops at the first
one), sorts the arrivals and shifts them to start at 0.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from blocktune.traces.cleaning import RowChecker
from blocktune.traces.formats import (
    FORMATS,
    GENERIC_FORMATS,
    NAMED_FORMATS,
    TIME_UNITS,
    FormatSpec,
    check_columns,
    detect_spec,
    generic_spec,
    guess_container,
    without_times,
)
from blocktune.traces.readers import iter_chunks, read_head, read_header
from blocktune.traces.schema import CANONICAL_COLUMNS, PREFIX_COLUMNS, TraceError

__all__ = ["FORMATS", "LoadedTrace", "TraceError", "load_trace"]


@dataclass(frozen=True)
class LoadedTrace:
    """A loaded trace: the canonical table and what loading it skipped or noticed.

    `skipped` maps a reason (see `schema.REASONS`) to its count and
    `first_bad_lines` to its first (up to 5) 1-based line numbers in the file
    (row numbers for Parquet).
    """

    frame: pd.DataFrame
    format: str
    path: Path
    rows_read: int
    skipped: dict[str, int]
    first_bad_lines: dict[str, list[int]]
    warnings: list[str]


def load_trace(
    path: str | os.PathLike[str],
    fmt: str = "auto",
    *,
    strict: bool = False,
    rate: float | None = None,
    seed: int = 0,
    time_col: str | None = None,
    time_unit: str = "s",
    prompt_col: str | None = None,
    output_col: str | None = None,
    chunksize: int = 200_000,
) -> LoadedTrace:
    """Load `path` as format `fmt` (one of `FORMATS`).

    `rate` (requests/s) generates Poisson arrivals with `seed` instead of
    reading times; the ``lengths`` format needs it. `time_col`, `time_unit`
    (one of s, ms, us, ns, datetime), `prompt_col` and `output_col` map the
    columns of the ``csv``/``jsonl``/``parquet`` formats (with ``auto``, giving
    any of them selects the generic layout). Raises `TraceError` for an
    unreadable, empty or unusable file, bad arguments, and in `strict` mode for
    the first bad row.
    """
    path = Path(path)
    _check_arguments(path, fmt, rate, time_unit, chunksize)
    mapped = any(c is not None for c in (time_col, prompt_col, output_col))
    if fmt in NAMED_FORMATS and (mapped or time_unit != "s"):
        raise TraceError(
            f"{path}: column mapping (time_col, time_unit, prompt_col, output_col) applies "
            f"to the csv, jsonl and parquet formats, not to {fmt!r}"
        )
    if rate is not None and time_col is not None:
        raise TraceError(f"{path}: give either a time column or a rate, not both")
    if path.is_dir():
        raise TraceError(f"{path}: is a directory, not a trace file")
    head = read_head(path)
    container = fmt if fmt in GENERIC_FORMATS else guess_container(path, head)
    header, where = read_header(path, container)
    if fmt in NAMED_FORMATS:
        spec = NAMED_FORMATS[fmt]
    elif fmt == "auto" and not mapped:
        spec = detect_spec(container, header)
    else:
        spec = generic_spec(
            container,
            header,
            time_col=time_col,
            time_unit=time_unit,
            prompt_col=prompt_col,
            output_col=output_col,
        )
    replaced = None
    if rate is not None:
        replaced, spec = spec.time_col, without_times(spec)
    elif spec.time_col is None:
        raise TraceError(
            f"{path}: format {spec.name!r} has no arrival times; give a rate (requests/s)"
        )
    check_columns(spec, header, where)
    checker = RowChecker(path, spec, strict=strict)
    chunks = [checker.clean(c) for c in iter_chunks(path, container, spec.columns, chunksize)]
    if checker.rows_read == 0:
        raise TraceError(f"{path}: the file has a header but no rows")
    rows = pd.concat(chunks, ignore_index=True)
    if rows.empty:
        raise TraceError(
            f"{path}: no usable rows out of {checker.rows_read}; "
            f"skipped: {checker.tally.describe()}"
        )
    frame, warnings = _arrange(rows, spec, path, rate, seed)
    if replaced is not None:
        warnings.append(
            f"the rate of {rate:g} requests/s replaces the trace's own arrival times "
            f"(column {replaced!r}) with Poisson arrivals"
        )
    return LoadedTrace(
        frame=frame,
        format=spec.name,
        path=path,
        rows_read=checker.rows_read,
        skipped=dict(checker.tally.counts),
        first_bad_lines={k: list(v) for k, v in checker.tally.first_lines.items()},
        warnings=warnings,
    )


def _check_arguments(
    path: Path, fmt: str, rate: float | None, time_unit: str, chunksize: int
) -> None:
    if fmt not in FORMATS:
        raise TraceError(f"{path}: unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if time_unit not in TIME_UNITS:
        raise TraceError(
            f"{path}: unknown time unit {time_unit!r}; choose one of {', '.join(TIME_UNITS)}"
        )
    if rate is not None and not (math.isfinite(rate) and rate > 0):
        raise TraceError(f"{path}: the rate must be a positive number of requests/s, got {rate}")
    if chunksize < 1:
        raise TraceError(f"{path}: chunksize must be at least 1, got {chunksize}")


def _arrange(
    rows: pd.DataFrame, spec: FormatSpec, path: Path, rate: float | None, seed: int
) -> tuple[pd.DataFrame, list[str]]:
    """The canonical frame: arrivals from 0 in seconds, sorted; and any warnings."""
    warnings = []
    if rate is None:
        ticks = rows["_t"].to_numpy()
        arrival = (ticks - ticks.min()).astype(np.float64) / TIME_UNITS[spec.time_unit]
        backwards = np.flatnonzero(np.diff(arrival) < 0)
        if len(backwards):
            line = int(rows["_line"].iloc[backwards[0] + 1])
            warnings.append(
                f"{path}: timestamps are not sorted ({len(backwards)} rows earlier than the row "
                f"before them, the first at line {line}); rows sorted by arrival"
            )
    else:
        gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(rows))
        arrival = np.concatenate(([0.0], np.cumsum(gaps[:-1])))
    frame = rows.assign(arrival_s=arrival)
    columns = [*CANONICAL_COLUMNS, *(c for c in PREFIX_COLUMNS if c in frame)]
    frame = frame[columns].sort_values("arrival_s", kind="stable", ignore_index=True)
    return frame, warnings
