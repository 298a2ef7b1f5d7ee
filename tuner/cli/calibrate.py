"""`blocktune calibrate`: measure the costs of each block size on this machine, as YAML."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from blocktune.tuner.cli._common import (
    add_measurement_arguments,
    add_model_arguments,
    block_size_arg,
    positive_int,
)

__all__ = ["register"]

DEFAULT_BLOCK_SIZES = (8, 16, 32, 64, 128, 256)


def run_calibrate(args: argparse.Namespace) -> int:
    """Measure paged-attention time per block size over a grid of contexts and batch sizes,
    host bookkeeping per token and copy bandwidth; write a calibration YAML with provenance.
    With --engine, also time whole engine steps of a model (decode batches x contexts and
    admission steps, round-robin over the block sizes) and fit the simulator's step form to
    them jointly; --trace fits the grid's prefill chunks and contexts to a trace's lengths."""
    import torch

    from blocktune.runtime.model import ModelLoadError
    from blocktune.tuner.cli._common import load_shaped_model_from_args, set_threads
    from blocktune.tuner.measure.engine_measure import measure_engine_calibration
    from blocktune.tuner.measure.measure import default_grid, measure_calibration

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda asked for, but torch sees no CUDA device", file=sys.stderr)
        return 2
    grid_given = (args.batch_sizes, args.context_lens, args.prefill_chunks) != (None,) * 3
    chosen = args.model_shape is not None or args.model != "tiny-random" or args.clock != "wall"
    if (chosen or grid_given or args.trace is not None) and not args.engine:
        print(
            "error: --model, --model-shape, --clock, --trace and the grid flags apply to --engine",
            file=sys.stderr,
        )
        return 2
    if args.trace is not None and (args.context_lens or args.prefill_chunks):
        print(
            "error: --trace chooses the context lengths and prefill chunks; give either",
            file=sys.stderr,
        )
        return 2
    set_threads(args.threads)

    def progress(message: str) -> None:
        print(f"calibrate ({device}): {message}", file=sys.stderr)

    if not args.engine:
        grid = default_grid(device, quick=args.quick, block_sizes=tuple(args.block_sizes))
        calibration = measure_calibration(grid, device, progress=progress)
    else:
        try:
            model, name = load_shaped_model_from_args(args, device=device)
            grid = _engine_grid(args)
            if args.trace is not None:
                grid = _grid_for_trace(args, grid, model.config.max_position_embeddings)
                progress(
                    f"grid for {args.trace}: prefill chunks {list(grid.prefill_chunks)}, "
                    f"contexts {list(grid.context_lens)}"
                )
            calibration = measure_engine_calibration(
                model,
                name,
                grid,
                quick=args.quick,
                clock=args.clock,
                seed=args.seed,
                progress=progress,
            )
        except (ModelLoadError, ValueError) as error:  # TraceError is a ValueError too
            print(f"error: {error}", file=sys.stderr)
            return 2
    text = calibration.to_yaml()
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")
        progress(f"wrote {args.out}")
    return 0


def _engine_grid(args: argparse.Namespace):
    """The default engine grid (quick or full) with the dimensions given on the command line."""
    from dataclasses import replace

    from blocktune.tuner.measure.engine_measure import default_engine_grid

    grid = default_engine_grid(quick=args.quick, block_sizes=tuple(args.block_sizes))
    given = {
        name: tuple(getattr(args, name))
        for name in ("batch_sizes", "context_lens", "prefill_chunks")
        if getattr(args, name) is not None
    }
    return replace(grid, **given)


def _grid_for_trace(args: argparse.Namespace, grid, max_tokens: int):
    """`grid` fitted to the lengths of the first --trace-requests requests of --trace."""
    from blocktune.traces.loaders import load_trace
    from blocktune.tuner.measure.engine_measure import grid_for_lengths

    loaded = load_trace(
        args.trace,
        args.format,
        rate=1.0 if args.format == "lengths" else None,  # only the lengths matter here
        prompt_col=args.prompt_col,
        output_col=args.output_col,
    )
    frame = loaded.frame.sort_values("arrival_s").head(args.trace_requests)
    prompts = frame["prompt_tokens"].to_numpy()
    return grid_for_lengths(grid, prompts, prompts + frame["output_tokens"].to_numpy(), max_tokens)


def register(commands: argparse._SubParsersAction) -> None:
    """Add `calibrate` to the command line."""
    from blocktune.traces.formats import FORMATS
    from blocktune.tuner.cli.validate import DEFAULT_REQUESTS
    from blocktune.tuner.measure.engine_measure import default_engine_grid

    parser = commands.add_parser(
        "calibrate",
        help="measure kernel, bookkeeping and copy costs (and engine steps) per block size",
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
        type=block_size_arg,
        nargs="+",
        default=list(DEFAULT_BLOCK_SIZES),
        metavar="B",
        help="block sizes to measure (default: 8 16 32 64 128 256)",
    )
    parser.add_argument(
        "--engine",
        action="store_true",
        help="also time whole engine steps of --model and fit the simulator's step form "
        "(the kernel part is then measured for that model's attention shape)",
    )
    add_model_arguments(parser)
    full = default_engine_grid(quick=False, block_sizes=DEFAULT_BLOCK_SIZES)
    for name, help_text in (
        ("batch_sizes", "decode batch sizes"),
        ("context_lens", "context lengths of the decode batches"),
        ("prefill_chunks", "prefill chunk sizes (prompt tokens of one prefill step)"),
    ):
        default = " ".join(map(str, getattr(full, name)))
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=positive_int,
            nargs="+",
            metavar="N",
            help=f"--engine: {help_text} to time (default: {default})",
        )
    parser.add_argument(
        "--trace",
        metavar="FILE",
        help="--engine: fit the prefill chunks to this trace's longest prompt and the contexts "
        "to its longest request (within the model's positions), as `blocktune validate` does",
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="auto",
        help="--trace's format (default: auto)",
    )
    parser.add_argument("--prompt-col", help="--trace's prompt length column, if not standard")
    parser.add_argument("--output-col", help="--trace's output length column, if not standard")
    parser.add_argument(
        "--trace-requests",
        type=positive_int,
        default=DEFAULT_REQUESTS,
        metavar="N",
        help="--trace: fit the grid to its first N requests, as validate serves them "
        "(default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of random weights and prompts")
    add_measurement_arguments(parser)
    parser.set_defaults(handler=run_calibrate)
