"""The `--engine vllm` options `calibrate` and `validate` share: which vLLM to start, how.

Each block size gets a server of its own, started from `--vllm-command` (a
command line with `{block_size}` and `{port}`; by default vLLM's OpenAI server
from `--vllm-venv` serving `--model`), whose output goes to a log file per block
size in `--vllm-logs`. The server inherits this environment: set vLLM's own
variables (for the CPU build e.g. `VLLM_CPU_KVCACHE_SPACE`,
`VLLM_CPU_OMP_THREADS_BIND=nobind`) before running.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from blocktune.runtime.defaults import ENGINE_DTYPES

__all__ = [
    "DEFAULT_VLLM_VENV",
    "VENV_VARIABLE",
    "add_vllm_arguments",
    "vllm_model_folder",
    "vllm_setup",
]

VENV_VARIABLE = "BLOCKTUNE_VLLM_VENV"
DEFAULT_VLLM_VENV = ".venv-vllm"
"""Where `make vllm` builds vLLM's environment (relative to the working directory)."""
DEFAULT_VLLM_MODEL = Path("models") / "SmolLM2-135M-Instruct"
"""The model `make vllm` writes into that environment."""
DEFAULT_START_TIMEOUT_S = 600.0
DEFAULT_MAX_MODEL_LEN = 2048


def add_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    """--vllm-venv, --vllm-command, --vllm-logs, --vllm-start-timeout, --dtype,
    --max-model-len (the --model option is the caller's)."""
    group = parser.add_argument_group("--engine vllm")
    group.add_argument(
        "--vllm-venv",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"vLLM's virtual environment (default: ${VENV_VARIABLE}, else {DEFAULT_VLLM_VENV})",
    )
    group.add_argument(
        "--vllm-command",
        metavar="TEMPLATE",
        help="the command that starts a vLLM server, with {block_size} and {port} in it "
        "(default: VENV/bin/python -m vllm.entrypoints.openai.api_server --model MODEL "
        "--dtype DTYPE --enforce-eager --max-model-len N --host 127.0.0.1 --port {port} "
        "--block-size {block_size})",
    )
    group.add_argument(
        "--vllm-logs",
        type=Path,
        metavar="DIR",
        help="folder for each server's output, one file per block size (default: a new "
        "temporary folder, named when done)",
    )
    group.add_argument(
        "--vllm-start-timeout",
        type=float,
        default=DEFAULT_START_TIMEOUT_S,
        metavar="S",
        help="seconds a server may take to answer /health (default: %(default)g; loading a "
        "model takes a minute or two on a small CPU)",
    )
    group.add_argument(
        "--dtype",
        choices=ENGINE_DTYPES,
        default="float32",
        help="the served weights' dtype (default: %(default)s, as vLLM's CPU build needs)",
    )
    group.add_argument(
        "--max-model-len",
        type=int,
        default=DEFAULT_MAX_MODEL_LEN,
        metavar="N",
        help="the default command's --max-model-len (default: %(default)s)",
    )


def _venv(args: argparse.Namespace) -> Path:
    if args.vllm_venv is not None:
        return args.vllm_venv
    return Path(os.environ.get(VENV_VARIABLE) or DEFAULT_VLLM_VENV)


def vllm_model_folder(args: argparse.Namespace) -> Path:
    """The served model's Hugging Face folder: --model, or the one `make vllm` writes into
    the venv when --model was left at its default."""
    if args.model != "tiny-random":
        return Path(args.model)
    return _venv(args) / DEFAULT_VLLM_MODEL


def vllm_setup(args: argparse.Namespace) -> tuple[str, Path, Path]:
    """(command template, model folder, log folder) from the options; `ValueError` for a
    missing venv or model where the default command needs them (a command given serves
    what it names)."""
    from blocktune.tuner.measure.vllm_server import default_vllm_command

    model = vllm_model_folder(args)
    template = args.vllm_command
    if template is None:
        if not (model / "config.json").is_file():
            raise ValueError(f"{model}: no Hugging Face model folder (config.json); give --model")
        venv = _venv(args)
        if not (venv / "bin" / "python").exists():
            raise ValueError(
                f"{venv}: no vLLM environment (`make vllm` builds one; or give --vllm-venv "
                "or --vllm-command)"
            )
        template = default_vllm_command(venv, model, args.dtype, args.max_model_len)
    logs = args.vllm_logs or Path(tempfile.mkdtemp(prefix="blocktune-vllm-"))
    return template, model, logs
