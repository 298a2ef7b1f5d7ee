"""Read a trace file's header and stream its rows in bounded chunks.

Every chunk comes with the 1-based line number of each row in the file (for
Parquet: the 1-based row number), so a skipped row can be reported where a
person would look for it. Only the requested columns are kept.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from blocktune.traces.schema import TraceError

__all__ = ["Chunk", "iter_chunks", "read_head", "read_header"]

_HEAD_BYTES = 4096


@dataclass(frozen=True)
class Chunk:
    """Rows of one chunk: raw source columns, their line numbers, and unparsable lines."""

    raw: pd.DataFrame
    lines: np.ndarray
    malformed: np.ndarray


def read_head(path: Path) -> bytes:
    """The first bytes of `path`; `TraceError` if it cannot be read or is empty."""
    try:
        with path.open("rb") as handle:
            head = handle.read(_HEAD_BYTES)
    except OSError as exc:
        raise TraceError(f"{path}: cannot read the trace: {exc.strerror or exc}") from exc
    if not head.strip():
        raise TraceError(f"{path}: the file is empty")
    return head


def read_header(path: Path, container: str) -> tuple[list[str], str]:
    """The column names of `path` and where they were found (for error messages)."""
    if container == "csv":
        try:
            header = pd.read_csv(path, nrows=0)
        except (pd.errors.ParserError, UnicodeDecodeError) as exc:
            raise TraceError(f"{path}, line 1: not a readable CSV header: {exc}") from exc
        except pd.errors.EmptyDataError as exc:
            raise TraceError(f"{path}: the file is empty") from exc
        return [str(c) for c in header.columns], f"{path}, line 1 (header)"
    if container == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return list(pq.read_schema(path).names), f"{path} (Parquet schema)"
        except (pa.ArrowException, OSError) as exc:
            raise TraceError(f"{path}: not a readable Parquet file: {exc}") from exc
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            record = _parse_json_line(line)
            if isinstance(record, dict):
                return list(record), f"{path}, line {number} (first JSON object)"
    raise TraceError(f"{path}: no line holds a JSON object")


def iter_chunks(
    path: Path, container: str, columns: Sequence[str], chunksize: int
) -> Iterator[Chunk]:
    """Stream `columns` of `path` in chunks of at most `chunksize` rows."""
    if container == "csv":
        yield from _csv_chunks(path, columns, chunksize)
    elif container == "parquet":
        yield from _parquet_chunks(path, columns, chunksize)
    else:
        yield from _jsonl_chunks(path, columns, chunksize)


def _csv_chunks(path: Path, columns: Sequence[str], chunksize: int) -> Iterator[Chunk]:
    # Blank lines stay as all-missing rows so the row index maps to the file line.
    try:
        with pd.read_csv(
            path, usecols=list(columns), dtype=str, chunksize=chunksize, skip_blank_lines=False
        ) as reader:
            for frame in reader:
                lines = frame.index.to_numpy(dtype=np.int64) + 2
                malformed = np.zeros(len(frame), dtype=bool)
                yield Chunk(frame.reset_index(drop=True), lines, malformed)
    except (pd.errors.ParserError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: not a readable CSV file: {exc}") from exc


def _parquet_chunks(path: Path, columns: Sequence[str], chunksize: int) -> Iterator[Chunk]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    first = 1
    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=chunksize, columns=list(columns))
        for batch in batches:
            frame = batch.to_pandas()
            lines = np.arange(first, first + len(frame), dtype=np.int64)
            first += len(frame)
            yield Chunk(frame, lines, np.zeros(len(frame), dtype=bool))
    except (pa.ArrowException, OSError) as exc:
        raise TraceError(f"{path}: not a readable Parquet file: {exc}") from exc


def _jsonl_chunks(path: Path, columns: Sequence[str], chunksize: int) -> Iterator[Chunk]:
    values: dict[str, list] = {c: [] for c in columns}
    lines: list[int] = []
    malformed: list[bool] = []
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            record = _parse_json_line(line)
            ok = isinstance(record, dict)
            for column in columns:
                values[column].append(record.get(column) if ok else None)
            lines.append(number)
            malformed.append(not ok)
            if len(lines) == chunksize:
                yield _json_chunk(values, lines, malformed)
                values = {c: [] for c in columns}
                lines, malformed = [], []
    if lines:
        yield _json_chunk(values, lines, malformed)


def _json_chunk(values: dict[str, list], lines: list[int], malformed: list[bool]) -> Chunk:
    raw = pd.DataFrame({c: pd.Series(v, dtype=object) for c, v in values.items()})
    return Chunk(raw, np.asarray(lines, dtype=np.int64), np.asarray(malformed, dtype=bool))


def _parse_json_line(line: bytes) -> object:
    """The JSON value on `line`, or None when it is not valid JSON (or nested too deeply)."""
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        return None
