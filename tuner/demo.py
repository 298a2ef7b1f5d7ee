"""`blocktune demo`: the main job on the bundled defaults."""

from __future__ import annotations

import argparse

__all__ = ["register"]

DEMO_BLOCK_SIZES = (8, 16, 32, 64)
# The model shape the demo states its KV bytes for: Llama-3-8B-like, bf16.
DEMO_SHAPE = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "dtype_bytes": 2}


def format_bytes(value: float) -> str:
    """Bytes in binary units with one decimal ("1.5 GiB")."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def run_demo(args: argparse.Namespace) -> int:
    """Replay a synthetic customer-service workload through the BlockManager per block size."""
    from blocktune.runtime.kv_cache import kv_bytes
    from blocktune.traces.synth import customer_service_day
    from blocktune.tuner.block_replay import replay_block_manager

    trace = customer_service_day(args.seed, duration_s=args.duration, rate_scale=args.rate_scale)
    per_slot = kv_bytes(**DEMO_SHAPE, num_slots=1)
    print(
        f"workload: synthetic customer-service day, seed {args.seed}, {len(trace)} requests "
        f"over {args.duration:.0f} s, median prompt {trace.prompt_tokens.median():.0f} "
        f"tokens, median output {trace.output_tokens.median():.0f} tokens"
    )
    print(
        "model shape: 32 layers x 8 KV heads x head_dim 128, bf16 "
        f"({format_bytes(per_slot)} of K+V per token)"
    )
    print(f"{'block':>5}  {'peak blocks':>11}  {'peak KV':>10}  {'padding':>7}  {'mean pad':>10}")
    for block_size in args.block_sizes:
        stats = replay_block_manager(trace, block_size, step_s=args.step)
        mean_padding = stats.padding_slot_steps / stats.steps * per_slot
        print(
            f"{block_size:>5}  {stats.peak_blocks:>11}  "
            f"{format_bytes(stats.peak_slots * per_slot):>10}  "
            f"{stats.padding_ratio:>7.1%}  {format_bytes(mean_padding):>10}"
        )
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    """Add `demo` to the command line."""
    demo = commands.add_parser(
        "demo",
        help="replay a synthetic customer-service workload at several block sizes",
        description=run_demo.__doc__,
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
    demo.set_defaults(handler=run_demo)
