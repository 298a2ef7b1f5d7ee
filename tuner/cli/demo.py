"""`blocktune demo`: the whole loop live — a worker, a sidecar, shifting traffic, hot swaps."""

from __future__ import annotations

import argparse

__all__ = ["register"]


def run_demo(args: argparse.Namespace) -> int:
    """Start a worker and a sidecar on loopback, drive a compressed customer-service day
    through them, print a line per interval, and verify every completion."""
    from blocktune.tuner.serving.closed_loop import run_closed_loop

    report = run_closed_loop(
        duration_s=args.duration,
        interval_s=args.interval,
        rate_per_s=args.rate,
        seed=args.seed,
    )
    return 0 if report.ok else 1


def register(commands: argparse._SubParsersAction) -> None:
    """Add `demo` to the command line."""
    demo = commands.add_parser(
        "demo",
        help="the closed loop live: worker + sidecar on loopback, traffic, hot swaps",
        description=(
            "Starts `blocktune worker` (tiny-random model) and `blocktune serve` on loopback, "
            "sends a compressed customer-service day (daytime mix, a promotion burst of short "
            "queries, the daytime mix again), prints the rate, median length, chosen block "
            "size, swap and KV blocks in use every interval, and finally checks every "
            "completion against an engine that never swaps. Exits 1 if any differs or fails."
        ),
    )
    demo.add_argument("--seed", type=int, default=0, help="workload and model seed (default 0)")
    demo.add_argument(
        "--duration", type=float, default=60.0, help="seconds of traffic (default 60)"
    )
    demo.add_argument(
        "--interval", type=float, default=4.0, help="sidecar decision interval, s (default 4)"
    )
    demo.add_argument(
        "--rate",
        type=float,
        default=3.0,
        help="daytime requests per second; the burst sends three times as many (default 3)",
    )
    demo.set_defaults(handler=run_demo)
