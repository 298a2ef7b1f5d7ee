"""The TRACE argument with its loader flags (format, strictness, column mapping), the load
they ask for and the report of the rows it skipped."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from blocktune.traces.loaders import LoadedTrace

__all__ = ["add_load_arguments", "load_from_args", "report_skipped"]


def add_load_arguments(
    parser: argparse.ArgumentParser,
    *,
    trace_help: str = "trace file to read",
    trace_optional: bool = False,
    seed_help: str = "seed of the generated arrivals (default: 0)",
) -> None:
    """The TRACE argument and the loader flags (format, strictness, column mapping)."""
    from blocktune.traces.formats import FORMATS, TIME_UNITS

    if trace_optional:
        parser.add_argument("trace", metavar="TRACE", nargs="?", default=None, help=trace_help)
    else:
        parser.add_argument("trace", metavar="TRACE", help=trace_help)
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="auto",
        help="trace format (default: auto, guessed from the header and the extension)",
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="stop at the first bad row, naming its line and column, instead of skipping it",
    )
    parser.add_argument(
        "--rate",
        type=float,
        help="generate Poisson arrivals at this many requests/s (needed by --format lengths)",
    )
    parser.add_argument("--seed", type=int, default=0, help=seed_help)
    parser.add_argument(
        "--time-col", help="arrival time column of a csv/jsonl/parquet trace (default: arrival_s)"
    )
    parser.add_argument(
        "--time-unit",
        choices=tuple(TIME_UNITS),
        default="s",
        help="unit of --time-col; 'datetime' for date-time text (default: s)",
    )
    parser.add_argument(
        "--prompt-col",
        help="prompt length column of a csv/jsonl/parquet trace (default: prompt_tokens)",
    )
    parser.add_argument(
        "--output-col",
        help="output length column of a csv/jsonl/parquet trace (default: output_tokens)",
    )
    parser.add_argument(
        "--chunksize",
        type=int,
        default=200_000,
        help="rows read at a time, bounding memory on large files (default: 200000)",
    )


def load_from_args(args: argparse.Namespace) -> LoadedTrace:
    """`load_trace` with the flags of `add_load_arguments` (raises `TraceError`)."""
    from blocktune.traces.loaders import load_trace

    return load_trace(
        args.trace,
        args.format,
        strict=args.strict,
        rate=args.rate,
        seed=args.seed,
        time_col=args.time_col,
        time_unit=args.time_unit,
        prompt_col=args.prompt_col,
        output_col=args.output_col,
        chunksize=args.chunksize,
    )


def report_skipped(loaded: LoadedTrace) -> None:
    """Print to stderr the rows a load skipped, by reason, and its warnings."""
    from blocktune.tuner.replay.inputs import loader_warnings

    for line in loader_warnings(loaded):
        print(f"warning: {line}", file=sys.stderr)
