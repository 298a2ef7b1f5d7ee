"""The `blocktune` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from blocktune import __version__

__all__ = ["build_parser", "main"]

DEMO_BLOCK_SIZES = (8, 16, 32, 64)
# The model shape the demo states its KV bytes for: Llama-3-8B-like, bf16.
DEMO_SHAPE = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "dtype_bytes": 2}


def _format_bytes(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def cmd_demo(args: argparse.Namespace) -> int:
    """Replay a synthetic customer-service workload through the BlockManager per block size."""
    from blocktune.runtime.kv_cache import kv_bytes
    from blocktune.traces.synth import customer_service_day
    from blocktune.tuner.block_replay import replay_block_manager

    trace = customer_service_day(args.seed, duration_s=args.duration, rate_scale=args.rate_scale)
    shape = DEMO_SHAPE
    per_slot = kv_bytes(shape["num_layers"], shape["num_kv_heads"], shape["head_dim"], 2, 1)
    print(
        f"workload: synthetic customer-service day, seed {args.seed}, {len(trace)} requests "
        f"over {args.duration:.0f} s, median prompt {trace.prompt_tokens.median():.0f} "
        f"tokens, median output {trace.output_tokens.median():.0f} tokens"
    )
    print(
        "model shape: 32 layers x 8 KV heads x head_dim 128, bf16 "
        f"({_format_bytes(per_slot)} of K+V per token)"
    )
    print(f"{'block':>5}  {'peak blocks':>11}  {'peak KV':>10}  {'padding':>7}  {'mean pad':>10}")
    for block_size in args.block_sizes:
        stats = replay_block_manager(trace, block_size, step_s=args.step)
        mean_padding = stats.padding_slot_steps / stats.steps * per_slot
        print(
            f"{block_size:>5}  {stats.peak_blocks:>11}  "
            f"{_format_bytes(stats.peak_slots * per_slot):>10}  "
            f"{stats.padding_ratio:>7.1%}  {_format_bytes(mean_padding):>10}"
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="blocktune",
        description=(
            "Workload-adaptive block-size tuning for paged KV caches: measure what each "
            "KV block size costs a workload, pick one, and change it while serving."
        ),
    )
    parser.add_argument("--version", action="version", version=f"blocktune {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="replay a synthetic customer-service workload at several block sizes",
        description=cmd_demo.__doc__,
    )
    demo.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    demo.add_argument(
        "--duration",
        type=float,
        default=3600.0,
        help="seconds the day is compressed into (default: 3600)",
    )
    demo.add_argument(
        "--rate-scale",
        type=float,
        default=0.05,
        help="multiplier on every arrival rate (default: 0.05)",
    )
    demo.add_argument(
        "--step", type=float, default=0.05, help="seconds per decode step (default: 0.05)"
    )
    demo.add_argument(
        "--block-sizes",
        type=int,
        nargs="+",
        default=list(DEMO_BLOCK_SIZES),
        metavar="B",
        help="block sizes to compare (default: 8 16 32 64)",
    )
    demo.set_defaults(handler=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
