"""`blocktune calibrate`: measure the costs of each block size on this machine, as YAML."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from blocktune.tuner.cli.arguments import block_size_arg, positive_int
from blocktune.tuner.cli.measure_args import add_measurement_arguments
from blocktune.tuner.cli.model_args import add_model_arguments

__all__ = ["register"]

DEFAULT_BLOCK_SIZES = (8, 16, 32, 64, 128, 256)
DEFAULT_VLLM_BLOCK_SIZES = (32, 64, 128)
"""Sizes every vLLM attention backend accepts (the CPU one takes multiples of 32 only)."""


def run_calibrate(args: argparse.Namespace) -> int:
    """Measure paged-attention time per block size over a grid of contexts and batch sizes,
    host bookkeeping per token and copy bandwidth; write a calibration YAML with provenance.
    With --engine, also time whole engine steps of a model (decode batches x contexts and
    admission steps, round-robin over the block sizes) and fit the simulator's step form to
    them jointly; --trace fits the grid's prefill chunks and contexts to a trace's lengths.
    With --engine vllm, time a vLLM server instead (one start per block size) from its
    streamed tokens over batch sizes x context lengths, and fit the same step form."""
    if args.engine == "vllm":
        args.block_sizes = args.block_sizes or list(DEFAULT_VLLM_BLOCK_SIZES)
        return run_vllm_calibrate(args)
    args.block_sizes = args.block_sizes or list(DEFAULT_BLOCK_SIZES)
    import torch

    from blocktune.runtime.load_errors import ModelLoadError
    from blocktune.tuner.cli.measure_args import set_threads
    from blocktune.tuner.cli.model_args import load_shaped_model_from_args
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
    _write(calibration, args.out, progress)
    return 0


def run_vllm_calibrate(args: argparse.Namespace) -> int:
    """`calibrate --engine vllm` (see `tuner.measure.vllm_measure`)."""
    import httpx

    from blocktune.tuner.cli.vllm_engine import vllm_setup
    from blocktune.tuner.measure.engine_measure import describe_fit
    from blocktune.tuner.measure.vllm_measure import (
        default_vllm_grid,
        hf_model_shape,
        measure_vllm_calibration,
    )
    from blocktune.tuner.measure.vllm_server import VllmStartError

    def progress(message: str) -> None:
        print(f"calibrate (vllm): {message}", file=sys.stderr, flush=True)

    unused = [
        flag
        for flag, given in (
            ("--device", args.device is not None),
            ("--model-shape", args.model_shape is not None),
            ("--prefill-chunks", args.prefill_chunks is not None),
            ("--trace", args.trace is not None),
            ("--threads", args.threads is not None),
            ("--clock", args.clock != "wall"),
        )
        if given
    ]
    if unused:
        print(f"error: {', '.join(unused)} do not apply to --engine vllm", file=sys.stderr)
        return 2
    try:
        template, folder, logs = vllm_setup(args)
        model = hf_model_shape(folder, folder.name, args.dtype)
        grid = default_vllm_grid(quick=args.quick, block_sizes=tuple(args.block_sizes))
        given = {
            name: tuple(getattr(args, name))
            for name in ("batch_sizes", "context_lens")
            if getattr(args, name) is not None
        }
        if args.decode_tokens is not None:
            given["decode_tokens"] = args.decode_tokens
        grid = replace(grid, **given)
        progress(f"servers' output in {logs}")
        calibration = measure_vllm_calibration(
            template,
            model,
            grid,
            logs,
            start_timeout_s=args.vllm_start_timeout,
            seed=args.seed,
            progress=progress,
        )
    except (ValueError, VllmStartError, httpx.HTTPError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for line in describe_fit(calibration.engine):
        progress(line)
    _write(calibration, args.out, progress)
    return 0


def _write(calibration, out: Path | None, progress) -> None:
    text = calibration.to_yaml()
    if out is None:
        sys.stdout.write(text)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")
        progress(f"wrote {out}")


def _engine_grid(args: argparse.Namespace):
    """The default engine grid (quick or full) with the dimensions given on the command line."""
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
    from blocktune.tuner.cli.vllm_engine import add_vllm_arguments

    parser = commands.add_parser(
        "calibrate",
        help="measure kernel, bookkeeping and copy costs (and engine steps) per block size",
        description=run_calibrate.__doc__,
    )
    _add_run_arguments(parser)
    add_model_arguments(parser)
    _add_grid_arguments(parser)
    _add_trace_arguments(parser)
    parser.add_argument("--seed", type=int, default=0, help="seed of random weights and prompts")
    add_measurement_arguments(parser)
    add_vllm_arguments(parser)
    parser.set_defaults(handler=run_calibrate)


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Where to measure, where the YAML goes, the block sizes and whether to time an engine."""
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
        default=None,
        metavar="B",
        help="block sizes to measure (default: 8 16 32 64 128 256; --engine vllm: 32 64 128)",
    )
    parser.add_argument(
        "--engine",
        nargs="?",
        const="blocktune",
        choices=("blocktune", "vllm"),
        default=None,
        help="also time whole engine steps of --model and fit the simulator's step form "
        "(the kernel part is then measured for that model's attention shape); "
        "--engine vllm: time a vLLM server's steps instead (--model: its Hugging Face "
        "folder), see the --engine vllm options",
    )


def _add_grid_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine grid's dimensions, each defaulting to the full grid's (and vLLM's)."""
    from blocktune.tuner.measure.engine_measure import default_engine_grid
    from blocktune.tuner.measure.vllm_measure import default_vllm_grid

    full = default_engine_grid(quick=False, block_sizes=DEFAULT_BLOCK_SIZES)
    vllm_full = default_vllm_grid(quick=False, block_sizes=DEFAULT_BLOCK_SIZES)
    vllm_defaults = {
        name: " ".join(map(str, getattr(vllm_full, name)))
        for name in ("batch_sizes", "context_lens")
    }
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
            help=f"--engine: {help_text} to time (default: {default}"
            + ("" if name == "prefill_chunks" else f"; vllm: {vllm_defaults[name]}")
            + ")",
        )
    parser.add_argument(
        "--decode-tokens",
        type=positive_int,
        metavar="N",
        help="--engine vllm: tokens each timed request generates "
        f"(default: {vllm_full.decode_tokens})",
    )


def _add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    """--trace and how to read it: the lengths the engine grid is fitted to."""
    from blocktune.traces.formats import FORMATS
    from blocktune.tuner.cli.validate import DEFAULT_REQUESTS

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
