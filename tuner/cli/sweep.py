"""`blocktune sweep SPEC.yaml`: replay traces x policies x a grid of settings on Dask.

Every point of the spec (trace x policy x setting) is replayed under every
block-size policy (static-B, adaptive, oracle) as Dask tasks, on a
`LocalCluster` of one process per core or, with ``--scheduler``, on a running
cluster. Writes ``DIR/results.parquet`` (one row per point and replayed
policy) and one ``goal-<n>.png`` per trace, and prints per trace and policy
the best setting and block size on the policy's goal and how the adaptive
policy compares there.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from blocktune.tuner.cli.arguments import positive_int

__all__ = ["register"]

DEFAULT_OUT = "sweep-out"
EXIT_INTERRUPTED = 130


def run_sweep_command(args: argparse.Namespace) -> int:
    """Replay every trace of SPEC under every policy and every setting of its grid (static
    block sizes, the adaptive tuner and the hindsight oracle each), as Dask tasks on a local
    cluster or on the one at --scheduler. Writes DIR/results.parquet and a plot per trace,
    and prints per trace and policy the best setting and block size on the policy's goal and
    the adaptive policy's goal value there over that size's.
    Exits 1 when some point failed (the others are written), 130 on Ctrl-C."""
    from blocktune.tuner.config.calibration import CalibrationError
    from blocktune.tuner.config.config_files import ConfigError
    from blocktune.tuner.sweep.executor import dask_client
    from blocktune.tuner.sweep.runner import run_sweep
    from blocktune.tuner.sweep.spec import load_sweep

    try:
        points = load_sweep(args.spec)
    except (ConfigError, CalibrationError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    counts = [len({getattr(p, part) for p in points}) for part in ("trace", "policy_name")]
    settings = len(points) // (counts[0] * counts[1])
    print(
        f"sweep: {len(points)} points: {counts[0]} traces x {counts[1]} policies x "
        f"{settings} settings",
        flush=True,
    )
    try:
        with dask_client(args.scheduler, args.workers) as client:
            workers = len(client.scheduler_info()["workers"])
            print(f"cluster: {client.scheduler.address} with {workers} workers", flush=True)
            result = run_sweep(client, points, progress=sys.stderr.isatty())
    except KeyboardInterrupt:
        print("cancelled: the sweep's tasks were cancelled, nothing written", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as exc:
        if args.scheduler is None:
            raise
        print(f"error: cannot reach the scheduler at {args.scheduler}: {exc}", file=sys.stderr)
        return 2
    return _write(result, Path(args.out))


def _write(result, out: Path) -> int:
    """Write the results and plots, print the summary and the failures; the exit status."""
    from blocktune.tuner.sweep.plots import write_plots
    from blocktune.tuner.sweep.results import summary_table

    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.parquet"
    result.rows.to_parquet(path, index=False)
    written = [path]
    if len(result.rows):
        print(summary_table(result.rows).to_string(index=False))
        written += write_plots(result.rows, out)
    for failure in result.failures:
        point = failure.point
        print(
            f"failed: trace {point.trace}, policy {point.policy_name}, setting {point.setting}: "
            f"{failure.error}",
            file=sys.stderr,
        )
    print(f"wrote {', '.join(map(str, written))} ({len(result.rows)} rows)")
    return 1 if result.failures else 0


def register(commands: argparse._SubParsersAction) -> None:
    """Add `sweep` to the command line."""
    parser = commands.add_parser(
        "sweep",
        help="replay traces x policies x a grid of settings as Dask tasks (local or a cluster)",
        description=run_sweep_command.__doc__,
    )
    parser.add_argument(
        "spec",
        metavar="SPEC.yaml",
        help="sweep spec: traces (files, globs or 'synthetic', with loader options and shards), "
        "policies (files or bundled names) and a grid of settings (see the README)",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--scheduler",
        metavar="ADDRESS",
        help="a running Dask scheduler, e.g. tcp://10.0.0.5:8786 (default: start a local "
        "cluster); its workers need blocktune and the spec's files",
    )
    where.add_argument(
        "--workers",
        type=positive_int,
        metavar="N",
        help="processes of the local cluster (default: one per core)",
    )
    parser.add_argument(
        "--out",
        default=DEFAULT_OUT,
        metavar="DIR",
        help="where results.parquet and the plots go (default: %(default)s)",
    )
    parser.set_defaults(handler=run_sweep_command)
