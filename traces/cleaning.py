"""Turn raw chunks of a trace into canonical rows, skipping and counting bad ones.

Each row is checked in the order of `schema.REASONS` (column by column within
a reason) and counted under its first failing check. In strict mode the first
bad row of the file raises `TraceError` naming the file, line and column
(rows dropped for a reason in `schema.NOT_ERRORS` are still only counted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from blocktune.traces.formats import FormatSpec
from blocktune.traces.readers import Chunk
from blocktune.traces.schema import MAX_TOKENS, NOT_ERRORS, REASONS, TraceError

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


@dataclass(frozen=True)
class _Parsed:
    """The values of one chunk, parsed column by column (invalid cells: NaN or None)."""

    times: np.ndarray | None
    bad_times: np.ndarray | None
    lengths: dict[str, np.ndarray]
    hashes: list[list[int] | None] | None

    @classmethod
    def of(cls, raw: pd.DataFrame, spec: FormatSpec) -> _Parsed:
        times = bad_times = hashes = None
        if spec.time_col:
            times, bad_times = _parse_times(raw[spec.time_col], spec.time_unit)
        if spec.hash_col:
            hashes = [parse_hashes(v, spec.hash_split) for v in raw[spec.hash_col]]
        lengths = {c: _numbers(raw[c]) for c in (spec.prompt_col, spec.output_col)}
        return cls(times, bad_times, lengths, hashes)


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
        self.rows_read += len(chunk.raw)
        parsed = _Parsed.of(chunk.raw, self.spec)
        checks = self._checks(chunk, parsed)
        code = np.full(len(chunk.raw), -1, dtype=np.int16)
        for index, check in enumerate(checks):
            code[check.bad & (code < 0)] = index
        if self.strict:
            self._raise_first(chunk, checks, code)
        reasons = np.array([check.reason for check in checks])
        for reason in dict.fromkeys(reasons):
            self.tally.add(reason, chunk.lines[np.isin(code, np.flatnonzero(reasons == reason))])
        return self._good_rows(chunk, parsed, code < 0)

    def _checks(self, chunk: Chunk, parsed: _Parsed) -> list[_Check]:
        """Every check of the chunk, in the order a row's reason is chosen."""
        spec, lengths = self.spec, parsed.lengths
        checks = [_Check("malformed_json", None, chunk.malformed)]
        for column in (spec.time_col, spec.prompt_col, spec.output_col):
            if column:
                checks.append(_Check("missing_value", column, chunk.raw[column].isna().to_numpy()))
        if spec.time_col:
            checks.append(_Check("bad_timestamp", spec.time_col, parsed.bad_times))
        for column, values in lengths.items():
            whole = np.isfinite(values) & (np.floor(values) == values)
            checks.append(_Check("non_integer_length", column, ~whole))
        for column, values in lengths.items():
            checks.append(_Check("negative_length", column, values < 0))
        for column, values in lengths.items():
            checks.append(_Check("length_over_limit", column, values > MAX_TOKENS))
        if spec.failed_when_output_zero:
            checks.append(_Check("failed_request", spec.output_col, lengths[spec.output_col] == 0))
        for column, values in lengths.items():
            checks.append(_Check("zero_length", column, values == 0))
        if parsed.hashes is not None:
            bad = np.array([h is None for h in parsed.hashes], dtype=bool)
            checks.append(_Check("bad_prefix_hashes", spec.hash_col, bad))
        return checks

    def _good_rows(self, chunk: Chunk, parsed: _Parsed, good: np.ndarray) -> pd.DataFrame:
        out = pd.DataFrame({"_line": chunk.lines[good]})
        if parsed.times is not None:
            out["_t"] = parsed.times[good]
        for name, column in (
            ("prompt_tokens", self.spec.prompt_col),
            ("output_tokens", self.spec.output_col),
        ):
            out[name] = parsed.lengths[column][good].astype(np.int64)
        if parsed.hashes is not None:
            kept = [h for h, ok in zip(parsed.hashes, good, strict=True) if ok]
            out["prefix_group"] = pd.Series(self._groups(chunk.raw, good, kept), dtype=object)
            out["prefix_hashes"] = pd.Series(kept, dtype=object)
        return out

    def _groups(self, raw: pd.DataFrame, good: np.ndarray, kept: list[list[int]]) -> list:
        if self.spec.group_col:
            groups = raw[self.spec.group_col][good]
            return [None if pd.isna(g) else str(g) for g in groups]
        # The group is the first source hash: undo the split of the first canonical hash.
        return [str(h[0] // self.spec.hash_split) if h else None for h in kept]

    def _raise_first(self, chunk: Chunk, checks: list[_Check], code: np.ndarray) -> None:
        """Raise `TraceError` for the chunk's first row that is an input error."""
        errors = np.isin(code, [i for i, c in enumerate(checks) if c.reason not in NOT_ERRORS])
        if not errors.any():
            return
        row = int(np.argmax(errors))
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
