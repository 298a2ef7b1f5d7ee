"""Write a canonical request table as CSV, JSON lines or Parquet, chosen by extension.

What is written loads back with `load_trace` (format ``auto``), prefix columns
included: in CSV the prefix hashes of a row are one cell of space-separated
integers; JSON lines and Parquet keep them as lists.
"""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from blocktune.traces.schema import TraceError

__all__ = ["WRITE_EXTENSIONS", "write_trace"]

WRITE_EXTENSIONS = {
    ".csv": "csv",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".pq": "parquet",
}


def write_trace(frame: pd.DataFrame, path: str | os.PathLike[str]) -> str:
    """Write `frame` to `path` in the container its extension names; returns the container."""
    path = Path(path)
    container = WRITE_EXTENSIONS.get(path.suffix.lower())
    if container is None:
        raise TraceError(
            f"{path}: cannot tell the output format from the extension {path.suffix!r}; "
            f"use one of {', '.join(WRITE_EXTENSIONS)}"
        )
    try:
        if container == "csv":
            text = frame
            if "prefix_hashes" in frame:
                joined = frame["prefix_hashes"].map(lambda hashes: " ".join(map(str, hashes)))
                text = frame.assign(prefix_hashes=joined)
            text.to_csv(path, index=False)
        elif container == "jsonl":
            frame.to_json(path, orient="records", lines=True)
        else:
            frame.to_parquet(path, index=False)
    except OSError as exc:
        raise TraceError(f"{path}: cannot write the trace: {exc.strerror or exc}") from exc
    return container
