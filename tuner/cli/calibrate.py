"""`blocktune calibrate`: measure the costs of each block size on this machine, as YAML."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from blocktune.kernels import is_power_of_two

__all__ = ["register"]

DEFAULT_BLOCK_SIZES = (8, 16, 32, 64, 128, 256)


def run_calibrate(args: argparse.Namespace) -> int:
    """Measure paged-attention time per block size over a grid of contexts and batch sizes,
    host bookkeeping per token and copy bandwidth; write a calibration YAML with provenance."""
    import torch

    from blocktune.tuner.core.measure import default_grid, measure_calibration

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda asked for, but torch sees no CUDA device", file=sys.stderr)
        return 2
    grid = default_grid(device, quick=args.quick, block_sizes=tuple(args.block_sizes))

    def progress(message: str) -> None:
        print(f"calibrate ({device}): {message}", file=sys.stderr)

    calibration = measure_calibration(grid, device, progress=progress)
    text = calibration.to_yaml()
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")
        progress(f"wrote {args.out}")
    return 0


def _block_size(text: str) -> int:
    value = int(text)
    if not is_power_of_two(value):
        raise argparse.ArgumentTypeError(f"block sizes must be powers of two, got {text}")
    return value


def register(commands: argparse._SubParsersAction) -> None:
    """Add `calibrate` to the command line."""
    parser = commands.add_parser(
        "calibrate",
        help="measure kernel, bookkeeping and copy costs per block size on this machine",
        description=run_calibrate.__doc__,
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default=None,
        help="where to measure: cuda (Triton kernels) or cpu (torch kernels); "
        "default: cuda when available",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="YAML file to write (default: standard output)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a tiny grid and small K/V shape: a smoke run in seconds, not a calibration to keep",
    )
    parser.add_argument(
        "--block-sizes",
        type=_block_size,
        nargs="+",
        default=list(DEFAULT_BLOCK_SIZES),
        metavar="B",
        help="block sizes to measure (default: 8 16 32 64 128 256)",
    )
    parser.set_defaults(handler=run_calibrate)
