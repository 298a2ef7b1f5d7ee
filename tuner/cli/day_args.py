"""The embedded customer-service day: its scale flags, and the request table of a command
that replays either that day or a TRACE file."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from blocktune.tuner.cli.arguments import positive_float
from blocktune.tuner.cli.trace_args import load_from_args, report_skipped
from blocktune.tuner.config.defaults import DEFAULT_DAY_RATE_SCALE, SYNTHETIC_TRACE

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["DayFlagError", "add_day_arguments", "load_trace_or_day"]

DAY_DURATION_S = 86_400.0


def add_day_arguments(parser: argparse.ArgumentParser) -> None:
    """--duration and --rate-scale: the scale of the embedded customer-service day."""
    parser.add_argument(
        "--duration",
        type=positive_float,
        default=None,
        help=f"embedded day: seconds the day spans (default: {DAY_DURATION_S:g}, a real day)",
    )
    parser.add_argument(
        "--rate-scale",
        type=positive_float,
        default=None,
        help="embedded day: multiplier on every arrival rate (default: "
        f"{DEFAULT_DAY_RATE_SCALE:g}, about 8000 requests; 1 is about 163000)",
    )


class DayFlagError(ValueError):
    """A flag of the embedded day given with a trace file."""


def load_trace_or_day(args: argparse.Namespace) -> tuple[pd.DataFrame, str]:
    """The request table and a label for it: the embedded day (TRACE absent or
    `SYNTHETIC_TRACE`, scaled by `add_day_arguments`) or the TRACE file, whose skipped rows
    and warnings are printed to standard error. The day's flags on a file are an error.
    Raises `TraceError`, `WorkloadError` or `DayFlagError`."""
    from blocktune.tuner.replay.inputs import embedded_day, file_label

    if args.trace in (None, SYNTHETIC_TRACE):
        args.duration = DAY_DURATION_S if args.duration is None else args.duration
        scale = DEFAULT_DAY_RATE_SCALE if args.rate_scale is None else args.rate_scale
        args.rate_scale = scale
        return embedded_day(args.seed, args.duration, args.rate_scale)
    for flag, value in (("--duration", args.duration), ("--rate-scale", args.rate_scale)):
        if value is not None:
            raise DayFlagError(f"{flag} changes the embedded day only, not the trace {args.trace}")
    loaded = load_from_args(args)
    report_skipped(loaded)
    return loaded.frame, file_label(loaded)
