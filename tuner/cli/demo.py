"""`blocktune demo`: the whole loop live — a worker, a sidecar, shifting traffic, hot swaps."""

from __future__ import annotations

import argparse
import sys

__all__ = ["register"]


def run_demo(args: argparse.Namespace) -> int:
    """Start a worker and a sidecar on loopback, drive a compressed customer-service day
    through them, print a line per interval, and verify every completion."""
    from blocktune.runtime.load_errors import ModelLoadError
    from blocktune.runtime.loading import TINY_RANDOM
    from blocktune.tuner.demo.closed_loop import run_closed_loop

    tiny = args.model == TINY_RANDOM
    try:
        report = run_closed_loop(
            model=args.model,
            duration_s=args.duration,
            interval_s=args.interval,
            rate_per_s=args.rate or (3.0 if tiny else 1.0),
            seed=args.seed,
            # SmolLM2's answers need a larger pool than the policy's 64 MiB for a Llama-8B.
            kv_bytes=None if tiny else "256MiB",
        )
    except ModelLoadError as error:
        print(
            f"blocktune demo: {error} (or run the quick path: --model tiny-random)", file=sys.stderr
        )
        return 2
    return 0 if report.ok else 1


def register(commands: argparse._SubParsersAction) -> None:
    """Add `demo` to the command line."""
    demo = commands.add_parser(
        "demo",
        help="the closed loop live: worker + sidecar on loopback, traffic, hot swaps",
        description=(
            "Starts `blocktune worker` and `blocktune serve` on loopback, sends a compressed "
            "customer-service day (daytime mix, a promotion burst of short queries, the "
            "daytime mix again), prints the rate, the sidecar window's median length, the "
            "chosen block size, swaps and KV blocks in use every interval, and finally checks "
            "every completion against an engine that never swaps. With a real model the "
            "traffic is customer-service chat through /v1/chat/completions and a few "
            "exchanges are printed; tiny-random sends token-id prompts (the quick path). "
            "Exits 1 if any completion differs or fails."
        ),
    )
    demo.add_argument(
        "--model",
        default="smollm2",
        help="smollm2 (SmolLM2-135M-Instruct, installed by make install), another model with a "
        "chat template (a folder or .gguf file), or tiny-random (default: %(default)s)",
    )
    demo.add_argument(
        "--seed", type=int, default=0, help="workload and model seed (default: %(default)s)"
    )
    demo.add_argument(
        "--duration", type=float, default=60.0, help="seconds of traffic (default: %(default)s)"
    )
    demo.add_argument(
        "--interval",
        type=float,
        default=4.0,
        help="sidecar decision interval in seconds (default: %(default)s)",
    )
    demo.add_argument(
        "--rate",
        type=float,
        default=None,
        help="daytime requests per second; the burst sends three times as many "
        "(default: 3 for tiny-random, 1 for a real model)",
    )
    demo.set_defaults(handler=run_demo)
