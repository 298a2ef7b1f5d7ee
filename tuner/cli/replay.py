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
    add_calibration_argument,
    add_day_arguments,
    add_load_arguments,
    load_policy_and_calibration,
    load_trace_or_day,
)
from blocktune.tuner.core.defaults import DEFAULT_POLICY

if TYPE_CHECKING:
    import pandas as pd

    from blocktune.tuner.core.policy import Policy

__all__ = ["register"]

PROGRESS_MIN_REQUESTS = 10_000


def run_replay(args: argparse.Namespace) -> int:
    """Replay a trace (default: the embedded customer-service day) under every block-size
    policy on a simulated continuous-batching server with the policy's KV budget: static-B
    for each candidate, the adaptive tuner (the sidecar's window and selector deciding every
    policy interval of trace time) and the hindsight oracle. Prints one row per policy."""
    from blocktune.traces.schema import TraceError
    from blocktune.traces.synth import WorkloadError
    from blocktune.tuner.cli._common import DayFlagError
    from blocktune.tuner.core.calibration import CalibrationError
    from blocktune.tuner.core.config_files import ConfigError
    from blocktune.tuner.replay.plots import write_plots
    from blocktune.tuner.replay.report import format_replay_table, report_dict, write_json
    from blocktune.tuner.replay.runner import ADAPTIVE, ReplayError, replay

    try:
        policy, calibration = load_policy_and_calibration(args.policy, args.calibration)
        frame, label = load_trace_or_day(args)
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
    except (
        ConfigError,
        TraceError,
        CalibrationError,
        WorkloadError,
        ReplayError,
        DayFlagError,
    ) as exc:
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
    add_day_arguments(parser)
    add_calibration_argument(parser)
    parser.set_defaults(handler=run_replay)
