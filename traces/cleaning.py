"""Turn raw chunks of a trace into canonical rows, skipping and counting bad ones.

Each row is checked in the order of `schema.REASONS` (column by column within
a reason) and counted under its first failing check. In strict mode the first
bad row of the file raises `TraceError` naming the file, line and column.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from blocktune.traces.formats import FormatSpec
from blocktune.traces.readers import Chunk
from blocktune.traces.schema import REASONS, TraceError

__all__ = ["FIRST_LINES_KEPT", "RowChecker", "SkipTally", "parse_hashes"]

FIRST_LINES_KEPT = 5


@dataclass
class SkipTally:
    """Skipped rows of one load: count and first line numbers per reason."""

    counts: dict[str, int] = field(default_factory=dict)
    first_lines: dict[str, list[int]] = field(default_factory=dict)

    def add(self, reason: str, lines: np.ndarray) -> None:
        """Count rows at `lines` (ascending) as skipped for `reason`."""
        if len(lines) == 0:
            return
        self.counts[reason] = self.counts.get(reason, 0) + len(lines)
        kept = self.first_lines.setdefault(reason, [])
        kept.extend(int(line) for line in lines[: FIRST_LINES_KEPT - len(kept)])

    def describe(self) -> str:
        """One line per reason: count and first lines."""
        return "; ".join(
            f"{reason} {count} (lines {', '.join(map(str, self.first_lines[reason]))})"
            for reason, count in self.counts.items()
        )


@dataclass(frozen=True)
class _Check:
    reason: str
    column: str | None
    bad: np.ndarray


class RowChecker:
    """Cleans the chunks of one file for one format; keeps the tally of skipped rows."""

    def __init__(self, path: Path, spec: FormatSpec, *, strict: bool) -> None:
        self.path = path
        self.spec = spec
        self.strict = strict
        self.tally = SkipTally()
        self.rows_read = 0

    def clean(self, chunk: Chunk) -> pd.DataFrame:
        """The good rows of `chunk`: ``_line``, ``_t`` (if timed), lengths, prefix columns."""
        spec, raw = self.spec, chunk.raw
        self.rows_read += len(raw)
        checks = [_Check("malformed_json", None, chunk.malformed)]
        missing = {
            c: raw[c].isna().to_numpy()
            for c in (spec.time_col, spec.prompt_col, spec.output_col)
            if c
        }
        checks += [_Check("missing_value", c, bad) for c, bad in missing.items()]
        out = pd.DataFrame({"_line": chunk.lines})
        if spec.time_col:
            out["_t"], bad_time = _parse_times(raw[spec.time_col], spec.time_unit)
            checks.append(_Check("bad_timestamp", spec.time_col, bad_time))
        lengths = {c: _numbers(raw[c]) for c in (spec.prompt_col, spec.output_col)}
        for column, values in lengths.items():
            whole = np.isfinite(values) & (np.floor(values) == values)
            checks.append(_Check("non_integer_length", column, ~whole))
        for column, values in lengths.items():
            checks.append(_Check("negative_length", column, values < 0))
        if spec.failed_when_output_zero:
            checks.append(_Check("failed_request", spec.output_col, lengths[spec.output_col] == 0))
        for column, values in lengths.items():
            checks.append(_Check("zero_length", column, values == 0))
        if spec.hash_col:
            hashes = [parse_hashes(v, spec.hash_split) for v in raw[spec.hash_col]]
            bad_hashes = np.fromiter((h is None for h in hashes), dtype=bool, count=len(raw))
            checks.append(_Check("bad_prefix_hashes", spec.hash_col, bad_hashes))
        code = np.full(len(raw), -1, dtype=np.int16)
        for index, check in enumerate(checks):
            code[check.bad & (code < 0)] = index
        if self.strict and (code >= 0).any():
            self._raise_first(chunk, checks, code)
        reasons = np.array([check.reason for check in checks])
        for reason in dict.fromkeys(reasons):
            self.tally.add(reason, chunk.lines[np.isin(code, np.flatnonzero(reasons == reason))])
        good = code < 0
        out["prompt_tokens"] = lengths[spec.prompt_col]
        out["output_tokens"] = lengths[spec.output_col]
        out = out[good].astype({"prompt_tokens": np.int64, "output_tokens": np.int64})
        if spec.hash_col:
            kept = [h for h, ok in zip(hashes, good, strict=True) if ok]
            out["prefix_group"] = pd.Series(self._groups(raw, good, kept), out.index, object)
            out["prefix_hashes"] = pd.Series(kept, index=out.index, dtype=object)
        return out.reset_index(drop=True)

    def _groups(self, raw: pd.DataFrame, good: np.ndarray, kept: list[list[int]]) -> list:
        if self.spec.group_col:
            groups = raw[self.spec.group_col][good]
            return [None if pd.isna(g) else str(g) for g in groups]
        # The group is the first source hash: undo the split of the first canonical hash.
        return [str(h[0] // self.spec.hash_split) if h else None for h in kept]

    def _raise_first(self, chunk: Chunk, checks: list[_Check], code: np.ndarray) -> None:
        row = int(np.argmax(code >= 0))
        check = checks[code[row]]
        where = f"{self.path}, line {chunk.lines[row]}"
        if check.column is None:
            raise TraceError(f"{where}: {REASONS[check.reason]}")
        value = chunk.raw[check.column].iloc[row]
        shown = "empty" if _is_missing(value) else repr(value)
        raise TraceError(
            f"{where}, column {check.column!r}: {REASONS[check.reason]} (value: {shown})"
        )


def _parse_times(values: pd.Series, unit: str) -> tuple[np.ndarray, np.ndarray]:
    """(times, unparsable) — int64 ns since the epoch for ``datetime``, else float ticks."""
    missing = values.isna().to_numpy()
    if unit == "datetime":
        parsed = pd.to_datetime(
            values.astype("string"), format="ISO8601", errors="coerce", utc=True
        )
        bad = parsed.isna().to_numpy() & ~missing
        ticks = parsed.dt.as_unit("ns").array.asi8
        return np.where(bad | missing, 0, ticks), bad
    numbers = _numbers(values)
    return numbers, ~np.isfinite(numbers) & ~missing


def _numbers(values: pd.Series) -> np.ndarray:
    """Float values of a column; NaN where a cell is not a number (JSON booleans included)."""
    if values.dtype == object:
        values = values.map(lambda v: None if isinstance(v, (bool, np.bool_)) else v)
    return pd.to_numeric(values, errors="coerce").to_numpy(dtype=np.float64)


def parse_hashes(value: object, split: int = 1) -> list[int] | None:
    """The canonical prefix hashes of one cell, or None when it is not a list of integers.

    Accepts a list/array of integers or text of integers separated by spaces or
    commas (optionally in brackets); a missing value is no hashes. Each source
    hash h becomes `split` canonical hashes h*split .. h*split + split - 1.
    """
    if _is_missing(value):
        return []
    if isinstance(value, str):
        items: object = value.strip().strip("[]").replace(",", " ").split()
    else:
        items = value
    if not isinstance(items, (list, tuple, np.ndarray)):
        return None
    hashes = []
    for item in items:
        number = _as_int(item)
        if number is None:
            return None
        hashes.extend(range(number * split, number * split + split))
    return hashes


def _as_int(item: object) -> int | None:
    if isinstance(item, (bool, np.bool_)):
        return None
    if isinstance(item, (int, np.integer)):
        return int(item)
    if isinstance(item, str):
        try:
            return int(item)
        except ValueError:
            return None
    return None


def _is_missing(value: object) -> bool:
    if value is None or value is pd.NA or value is pd.NaT:
        return True
    if isinstance(value, float) and math.isnan(value):
        return True
    return isinstance(value, str) and not value.strip()
