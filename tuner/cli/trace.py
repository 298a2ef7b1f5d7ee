"""`blocktune trace`: inspect a request trace, or write the synthetic customer-service day."""

from __future__ import annotations

import argparse
import sys

from blocktune.tuner.cli.trace_args import add_load_arguments, load_from_args

__all__ = ["register"]

PERCENTILES = (50, 90, 99)


def run_summary(args: argparse.Namespace) -> int:
    """Load a trace and print its row counts, skipped rows by reason and length percentiles."""
    import numpy as np

    from blocktune.traces.loaders import TraceError

    try:
        trace = load_from_args(args)
    except TraceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    frame = trace.frame
    span = float(frame.arrival_s.iloc[-1])
    rate = f", {len(frame) / span:.2f} requests/s" if span > 0 else ""
    print(f"trace: {trace.path} (format {trace.format})")
    print(f"rows: {trace.rows_read} read, {len(frame)} kept, {sum(trace.skipped.values())} skipped")
    for reason, count in trace.skipped.items():
        lines = ", ".join(map(str, trace.first_bad_lines[reason]))
        print(f"  skipped {reason}: {count} (first at lines {lines})")
    for warning in trace.warnings:
        print(f"warning: {warning}")
    print(f"arrivals: over {span:.1f} s{rate}")
    header = "".join(f"{'p' + str(p):>8}" for p in PERCENTILES)
    print(f"{'tokens':<8}{'min':>8}{header}{'max':>8}{'mean':>8}")
    for name, values in (
        ("prompt", frame.prompt_tokens),
        ("output", frame.output_tokens),
        ("total", frame.prompt_tokens + frame.output_tokens),
    ):
        cells = "".join(f"{v:>8.0f}" for v in np.percentile(values, PERCENTILES))
        print(f"{name:<8}{values.min():>8}{cells}{values.max():>8}{values.mean():>8.1f}")
    if "prefix_group" in frame:
        grouped = frame.prefix_group.notna()
        print(
            f"prefix groups: {frame.prefix_group[grouped].nunique()} "
            f"({int(grouped.sum())} requests carry one)"
        )
    return 0


def run_synth(args: argparse.Namespace) -> int:
    """Write the seeded synthetic customer-service day as CSV, JSON lines or Parquet."""
    from blocktune.traces.schema import TraceError
    from blocktune.traces.synth import WorkloadError, customer_service_day
    from blocktune.traces.writers import write_trace

    try:
        day = customer_service_day(args.seed, duration_s=args.duration, rate_scale=args.rate_scale)
        container = write_trace(day, args.out)
    except (TraceError, WorkloadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"wrote {len(day)} requests over {args.duration:.0f} s (seed {args.seed}) "
        f"to {args.out} as {container}"
    )
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    """Add `trace summary` and `trace synth` to the command line."""
    trace = commands.add_parser(
        "trace",
        help="inspect a request trace or write the synthetic customer-service day",
        description=__doc__,
    )
    actions = trace.add_subparsers(dest="trace_command", metavar="ACTION", required=True)
    summary = actions.add_parser(
        "summary",
        help="row counts, skipped rows and length percentiles of a trace",
        description=run_summary.__doc__,
    )
    add_load_arguments(summary)
    summary.set_defaults(handler=run_summary)
    synth = actions.add_parser(
        "synth", help="write the synthetic customer-service day", description=run_synth.__doc__
    )
    synth.add_argument(
        "--out",
        required=True,
        metavar="FILE",
        help="output file; .csv, .jsonl/.ndjson or .parquet/.pq picks the format",
    )
    synth.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    synth.add_argument(
        "--duration",
        type=float,
        default=86_400.0,
        help="seconds the day is compressed into (default: 86400, a real day)",
    )
    synth.add_argument(
        "--rate-scale",
        type=float,
        default=1.0,
        help="multiplier on every arrival rate (default: 1)",
    )
    synth.set_defaults(handler=run_synth)
