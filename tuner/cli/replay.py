"""`blocktune replay`: serve a trace under every block-size policy on the simulated server.

Without TRACE (or with ``synthetic``) it replays the embedded synthetic
customer-service day. Prints one row per policy (static-B for each candidate,
adaptive, oracle), the adaptive policy's switches and the ratios against the
oracle and static-16; `--out DIR` writes report.json and the PNG plots there,
`--json FILE` the same JSON object (``-`` prints it instead of the table).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from blocktune.tuner.cli._common import (
    SYNTHETIC,
    add_load_arguments,
    load_from_args,
    load_policy_and_calibration,
)
from blocktune.tuner.core.defaults import DEFAULT_POLICY

if TYPE_CHECKING:
    import pandas as pd

    from blocktune.tuner.core.policy import Policy

__all__ = ["register"]

DAY_DURATION_S = 86_400.0
DAY_RATE_SCALE = 0.05  # about 8000 requests: the embedded day replays in a few seconds
PROGRESS_MIN_REQUESTS = 10_000


def _load(args: argparse.Namespace) -> tuple[pd.DataFrame, str]:
    """The request table and a label for it: the embedded day or the TRACE file."""
    from blocktune.tuner.replay.runner import ReplayError

    if args.trace in (None, SYNTHETIC):
        from blocktune.traces.synth import customer_service_day

        args.duration = DAY_DURATION_S if args.duration is None else args.duration
        args.rate_scale = DAY_RATE_SCALE if args.rate_scale is None else args.rate_scale
        frame = customer_service_day(
            args.seed, duration_s=args.duration, rate_scale=args.rate_scale
        )
        label = (
            f"synthetic customer-service day (seed {args.seed}, {args.duration:g} s, "
            f"rate scale {args.rate_scale:g})"
        )
        return frame, label
    for flag, value in (("--duration", args.duration), ("--rate-scale", args.rate_scale)):
        if value is not None:
            raise ReplayError(f"{flag} changes the embedded day only, not the trace {args.trace}")
    loaded = load_from_args(args)
    skipped = sum(loaded.skipped.values())
    if skipped:
        reasons = ", ".join(f"{reason} {count}" for reason, count in loaded.skipped.items())
        print(f"skipped {skipped} of {loaded.rows_read} rows: {reasons}", file=sys.stderr)
    for warning in loaded.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return loaded.frame, f"{Path(args.trace).name} (format {loaded.format})"


def run_replay(args: argparse.Namespace) -> int:
    """Replay a trace (default: the embedded customer-service day) under every block-size
    policy on a simulated continuous-batching server with the policy's KV budget: static-B
    for each candidate, the adaptive tuner (the sidecar's window and selector deciding every
    policy interval of trace time) and the hindsight oracle. Prints one row per policy."""
    from blocktune.traces.schema import TraceError
    from blocktune.traces.synth import WorkloadError
    from blocktune.tuner.core.calibration import CalibrationError
    from blocktune.tuner.core.config_files import ConfigError
    from blocktune.tuner.replay.plots import write_plots
    from blocktune.tuner.replay.report import format_replay_table, report_dict, write_json
    from blocktune.tuner.replay.runner import ADAPTIVE, ReplayError, replay

    try:
        policy, calibration = load_policy_and_calibration(args.policy)
        frame, label = _load(args)
        if args.json != "-":
            _print_setup(frame, label, policy, args.policy, calibration.describe())
        report = replay(
            frame,
            policy,
            calibration,
            label=label,
            initial_block_size=args.initial_block_size,
            progress=len(frame) >= PROGRESS_MIN_REQUESTS,
        )
    except (ConfigError, TraceError, CalibrationError, WorkloadError, ReplayError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json == "-":
        print(json.dumps(report_dict(report), indent=2, allow_nan=False))
    else:
        print(format_replay_table(report))
        for warning in report.warnings:
            print(f"warning: {warning}")
        switches = report.runs[ADAPTIVE].switches
        steps = ", ".join(f"B={size} at {t:.0f} s" for _, t, size in switches) or "none"
        print(f"adaptive: starts at B={report.policy['initial_block_size']}; switches: {steps}")
    written = []
    if args.json not in (None, "-"):
        write_json(report, Path(args.json))
        written.append(args.json)
    if args.out is not None:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_json(report, out / "report.json")
        written += [str(out / "report.json"), *map(str, write_plots(report, out))]
    if written:
        print(f"wrote {', '.join(written)}", file=sys.stderr if args.json == "-" else sys.stdout)
    return 0


def _print_setup(
    frame: pd.DataFrame, label: str, policy: Policy, policy_file: str, calibration: str
) -> None:
    """What is about to be replayed: the trace, the deployment and the calibration."""
    span = float(frame.arrival_s.max() - frame.arrival_s.min())
    shared = int(frame.prefix_group.notna().sum()) if "prefix_group" in frame else 0
    print(
        f"trace: {label}: {len(frame)} requests over {span:.0f} s, median prompt "
        f"{frame.prompt_tokens.median():.0f} and output {frame.output_tokens.median():.0f} "
        f"tokens, {shared} in a prefix group"
    )
    print(
        f"policy: {policy.deployment} ({policy_file}): KV budget "
        f"{int(policy.kv_budget) / 2**30:.2f} GiB, candidates "
        f"{' '.join(map(str, policy.candidates))}, decisions every "
        f"{policy.interval.total_seconds():g} s, min_dwell {policy.min_dwell.total_seconds():g} s"
    )
    print(f"calibration: {calibration}", flush=True)


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def register(commands: argparse._SubParsersAction) -> None:
    """Add `replay` to the command line."""
    parser = commands.add_parser(
        "replay",
        help="compare static, adaptive and oracle block sizes on a trace (simulated server)",
        description=run_replay.__doc__,
    )
    add_load_arguments(
        parser,
        trace_help=f"trace file (default, or '{SYNTHETIC}': the embedded customer-service day)",
        trace_optional=True,
        seed_help="seed of the embedded day or of --rate arrivals (default: 0)",
    )
    parser.add_argument(
        "--policy",
        default=DEFAULT_POLICY,
        metavar="FILE|NAME",
        help="policy YAML file or bundled policy name: model, KV budget, candidates, timing "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="write report.json and the PNG plots (lengths, adaptive timeline, policies) here",
    )
    parser.add_argument(
        "--json",
        metavar="FILE",
        help="write the report as JSON to FILE ('-': print it instead of the table)",
    )
    parser.add_argument(
        "--initial-block-size",
        type=int,
        metavar="B",
        help="block size the adaptive policy starts at (default: the candidate nearest 16)",
    )
    parser.add_argument(
        "--duration",
        type=_positive_float,
        default=None,
        help=f"embedded day: seconds the day spans (default: {DAY_DURATION_S:g}, a real day)",
    )
    parser.add_argument(
        "--rate-scale",
        type=_positive_float,
        default=None,
        help=f"embedded day: multiplier on every arrival rate (default: {DAY_RATE_SCALE:g}, "
        "about 8000 requests; 1 is about 163000)",
    )
    parser.set_defaults(handler=run_replay)
