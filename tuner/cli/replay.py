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
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from blocktune.tuner.cli.arguments import positive_int
from blocktune.tuner.cli.day_args import DayFlagError, add_day_arguments, load_trace_or_day
from blocktune.tuner.cli.policy_args import (
    add_calibration_argument,
    add_policy_argument,
    load_policy_and_calibration,
)
from blocktune.tuner.cli.trace_args import add_load_arguments
from blocktune.tuner.config.defaults import SYNTHETIC_TRACE

if TYPE_CHECKING:
    import pandas as pd

    from blocktune.tuner.config.calibration import Calibration
    from blocktune.tuner.config.policy import Policy
    from blocktune.tuner.replay.runner import ReplayReport

__all__ = ["register"]

PROGRESS_MIN_REQUESTS = 10_000


def _replay(
    frame: pd.DataFrame, policy: Policy, calibration: Calibration, label: str, args
) -> ReplayReport:
    """The replay, its policies in --jobs worker processes (no more than there are policies;
    1: here, one after another), with progress bars on a terminal for long traces."""
    from blocktune.tuner.replay.runner import replay

    progress = len(frame) >= PROGRESS_MIN_REQUESTS and sys.stderr.isatty()
    if args.jobs == 1:
        return replay(
            frame,
            policy,
            calibration,
            label=label,
            initial_block_size=args.initial_block_size,
            progress=progress,
        )
    from blocktune.tuner.replay.runner import policy_names
    from blocktune.tuner.sweep.executor import dask_client, submit_replay, track

    with dask_client(workers=min(args.jobs, len(policy_names(policy)))) as client:
        submitted = submit_replay(
            client,
            client.scatter(frame),
            policy,
            calibration,
            label=label,
            initial_block_size=args.initial_block_size,
        )
        track(client, submitted.plays, desc="policies", progress=progress)
        return submitted.report.result()


def run_replay(args: argparse.Namespace) -> int:
    """Replay a trace (default: the embedded customer-service day) under every block-size
    policy on a simulated continuous-batching server with the policy's KV budget: static-B
    for each candidate, the adaptive tuner (the sidecar's window and selector deciding every
    policy interval of trace time) and the hindsight oracle. Prints one row per policy."""
    from blocktune.traces.schema import TraceError
    from blocktune.traces.synth import WorkloadError
    from blocktune.tuner.config.calibration import CalibrationError
    from blocktune.tuner.config.config_files import ConfigError
    from blocktune.tuner.fidelity.fidelity import load_fidelity
    from blocktune.tuner.replay.plots import write_plots
    from blocktune.tuner.replay.report import format_replay_table, report_dict, write_json
    from blocktune.tuner.replay.runner import ADAPTIVE, ReplayError

    try:
        policy, calibration = load_policy_and_calibration(args.policy, args.calibration)
        fidelity = None if args.validation is None else load_fidelity(args.validation)
        frame, label = load_trace_or_day(args)
        if args.json != "-":
            _print_setup(frame, label, policy, args.policy, calibration.describe())
        report = _replay(frame, policy, calibration, label, args)
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
    if fidelity is not None:
        report = replace(
            report,
            fidelity=fidelity.to_dict(),
            warnings=[*report.warnings, *fidelity.warnings(calibration.describe())],
        )
    if args.json == "-":
        print(json.dumps(report_dict(report), indent=2, allow_nan=False))
    else:
        print(format_replay_table(report))
        if fidelity is not None:
            print(fidelity.summary())
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
    from blocktune.tuner.replay.report import format_bytes

    span = float(frame.arrival_s.max() - frame.arrival_s.min())
    shared = int(frame.prefix_group.notna().sum()) if "prefix_group" in frame else 0
    print(
        f"trace: {label}: {len(frame)} requests over {span:.0f} s, median prompt "
        f"{frame.prompt_tokens.median():.0f} and output {frame.output_tokens.median():.0f} "
        f"tokens, {shared} in a prefix group"
    )
    print(
        f"policy: {policy.deployment} ({policy_file}): KV budget "
        f"{format_bytes(int(policy.kv_budget))}, candidates "
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
        trace_help=f"trace file (default, or '{SYNTHETIC_TRACE}': the embedded "
        "customer-service day)",
        trace_optional=True,
        seed_help="seed of the embedded day or of --rate arrivals (default: 0)",
    )
    add_policy_argument(parser, "model, KV budget, candidates, timing")
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
        help="block size the adaptive policy starts at (default: the policy's "
        "server.initial_block_size, else the candidate nearest 16)",
    )
    parser.add_argument(
        "--jobs",
        type=positive_int,
        default=os.cpu_count() or 1,
        metavar="N",
        help="replay the policies in N worker processes, a local Dask cluster; 1 replays them "
        "here, one after another (default: the cores, %(default)s)",
    )
    add_day_arguments(parser)
    add_calibration_argument(parser)
    parser.add_argument(
        "--validation",
        metavar="FILE",
        help="the JSON of `blocktune validate` for this calibration: its fidelity (how far "
        "the simulator was from the live engine) goes into the report, with warnings where it "
        "misses its goals",
    )
    parser.set_defaults(handler=run_replay)
