"""Where each trace format keeps the canonical fields, and how `auto` recognises it.

A format is a column layout (`FormatSpec`); the container a file is stored in
(CSV, JSON lines or Parquet) comes from its extension or its first bytes, so an
Azure trace saved as Parquet still loads as ``azure``. The ``csv``, ``jsonl``
and ``parquet`` formats fix the container and take their columns from the
mapping flags (default: the canonical names, so a written synthetic day loads
back as it is).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from blocktune.traces.schema import TraceError

__all__ = [
    "CONTAINERS",
    "FORMATS",
    "GENERIC_FORMATS",
    "NAMED_FORMATS",
    "TIME_UNITS",
    "FormatSpec",
    "check_columns",
    "detect_spec",
    "generic_spec",
    "guess_container",
    "without_times",
]

CONTAINERS = ("csv", "jsonl", "parquet")
GENERIC_FORMATS = CONTAINERS

TIME_UNITS = {"s": 1.0, "ms": 1e3, "us": 1e6, "ns": 1e9, "datetime": 1e9}
"""Time units and their ticks per second; ``datetime`` columns hold date-time text."""

_EXTENSIONS = {
    ".csv": "csv",
    ".txt": "csv",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".parquet": "parquet",
    ".pq": "parquet",
}


@dataclass(frozen=True)
class FormatSpec:
    """The source columns of one format and how to read them.

    `time_col` None means the trace has no arrival times: they are generated
    (Poisson at a given rate). `hash_split` is how many canonical prefix hashes
    one source hash becomes (`PREFIX_BLOCK_TOKENS` per canonical hash). Without a
    `group_col`, the prefix group is the first source hash of the row.
    """

    name: str
    time_col: str | None
    time_unit: str
    prompt_col: str
    output_col: str
    hash_col: str | None = None
    hash_split: int = 1
    group_col: str | None = None
    failed_when_output_zero: bool = False

    @property
    def required(self) -> tuple[str, ...]:
        """Columns a file must have for this format, in checking order."""
        columns = (self.time_col, self.prompt_col, self.output_col, self.hash_col)
        return tuple(c for c in columns if c is not None)

    @property
    def columns(self) -> tuple[str, ...]:
        """Every column that is read."""
        return self.required + ((self.group_col,) if self.group_col else ())


NAMED_FORMATS: dict[str, FormatSpec] = {
    spec.name: spec
    for spec in (
        FormatSpec("azure", "TIMESTAMP", "datetime", "ContextTokens", "GeneratedTokens"),
        FormatSpec(
            "burstgpt",
            "Timestamp",
            "s",
            "Request tokens",
            "Response tokens",
            failed_when_output_zero=True,
        ),
        FormatSpec(
            "mooncake",
            "timestamp",
            "ms",
            "input_length",
            "output_length",
            hash_col="hash_ids",
            hash_split=2,
        ),
        FormatSpec("lengths", None, "s", "num_prefill_tokens", "num_decode_tokens"),
    )
}
"""Public trace layouts; `auto` tries them in this order."""

FORMATS: tuple[str, ...] = ("auto", *NAMED_FORMATS, *GENERIC_FORMATS)
"""Every format name `load_trace` accepts, ``auto`` first."""


def guess_container(path: Path, head: bytes) -> str:
    """The container of `path` from its extension, else from its first bytes."""
    by_extension = _EXTENSIONS.get(path.suffix.lower())
    if by_extension:
        return by_extension
    if head.startswith(b"PAR1"):
        return "parquet"
    return "jsonl" if head.lstrip().startswith(b"{") else "csv"


def generic_spec(
    container: str,
    header: Sequence[str],
    *,
    time_col: str | None,
    time_unit: str,
    prompt_col: str | None,
    output_col: str | None,
) -> FormatSpec:
    """The layout of a team's own file: mapped columns, canonical names by default.

    Canonical ``prefix_hashes`` / ``prefix_group`` columns are read when present.
    """
    present = set(header)
    return FormatSpec(
        container,
        time_col or "arrival_s",
        time_unit,
        prompt_col or "prompt_tokens",
        output_col or "output_tokens",
        hash_col="prefix_hashes" if "prefix_hashes" in present else None,
        group_col="prefix_group" if "prefix_group" in present else None,
    )


def detect_spec(container: str, header: Sequence[str]) -> FormatSpec:
    """The first named format whose columns `header` has, else the generic layout."""
    present = set(header)
    for spec in NAMED_FORMATS.values():
        if set(spec.required) <= present:
            return spec
    return generic_spec(
        container, header, time_col=None, time_unit="s", prompt_col=None, output_col=None
    )


def without_times(spec: FormatSpec) -> FormatSpec:
    """`spec` with its time column dropped, for arrivals generated at a rate."""
    return replace(spec, time_col=None)


def check_columns(spec: FormatSpec, header: Sequence[str], where: str) -> None:
    """Raise `TraceError` naming the first column of `spec` missing from `header`."""
    present = set(header)
    for column in spec.required:
        if column not in present:
            found = ", ".join(repr(c) for c in header) or "none"
            raise TraceError(
                f"{where}: missing column {column!r} needed by format {spec.name!r} "
                f"(columns found: {found})"
            )
