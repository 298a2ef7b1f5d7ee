"""A Llama-architecture decoder that reads and writes a paged KV cache.

RMSNorm, rotary position embeddings (`rope_theta`, the half-split layout of
Hugging Face checkpoints, optionally Llama-3's frequency scaling), grouped-query
attention, a SwiGLU MLP and optionally tied embeddings. Parameter names follow
the Hugging Face Llama checkpoint layout; `blocktune.runtime.loading` reads
checkpoints into it.

Two ways through the layers:

- `forward_dense(token_ids)`: plain causal attention without any cache, the
  reference the paged path is tested against;
- `forward_step(...)`: one engine step in one pass over the weights: one new
  token for each of a batch of decoding sequences and chunks of new tokens of
  prefilling ones. Every new token's K/V is written to its slot; a decode
  token attends through the block table with the paged kernel, a chunk's
  tokens attend causally over their sequence's whole context (a cached prefix
  and earlier chunks included) read back through its slots.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from blocktune.kernels.cache_ops import write_kv
from blocktune.kernels.cpu_attention import CPU_DTYPES, paged_attention_cpu
from blocktune.kernels.cpu_layer_ops import (
    add_rms_norm,
    fused_ops_apply,
    rotate_heads,
    silu_and_mul,
)
from blocktune.kernels.paged_attention import decode_layout, paged_attention
from blocktune.runtime.kv_cache import KVCache
from blocktune.runtime.linear import FusedProjections, PackedLinear
from blocktune.runtime.load_errors import ModelLoadError, UnsupportedModelError

__all__ = [
    "Llama3RopeScaling",
    "LlamaModel",
    "ModelConfig",
]

SUPPORTED_MODEL_TYPES = ("llama", "mistral")  # Mistral only without a sliding window
# On the cpu backend a prefill chunk of at most this many new tokens attends through the
# C kernel, each token one query row over its slots (no gather, no call of its own); a
# longer one through torch's fused attention, which reuses each K/V tile for all its rows.
IN_PLACE_CHUNK_TOKENS = 16


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama-3's rotary scaling (`rope_type: llama3`): long wavelengths are stretched by
    `factor`, short ones kept, and those between blended."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def rescale(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """Scaled inverse frequencies for unscaled `inv_freq`."""
        # How many times each frequency's wavelength fits in the original context: below
        # low_freq_factor the frequency is divided by `factor`, above high_freq_factor it is
        # kept, and in between the two are mixed linearly in this ratio.
        ratio = self.original_max_position_embeddings * inv_freq / (2 * math.pi)
        span = self.high_freq_factor - self.low_freq_factor
        keep = ((ratio - self.low_freq_factor) / span).clamp(0.0, 1.0)
        return inv_freq * (keep + (1 - keep) / self.factor)


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-architecture model."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    rope_scaling: Llama3RopeScaling | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )

    @classmethod
    def tiny(cls) -> ModelConfig:
        """A small random model for tests and demos (byte-level vocabulary)."""
        return cls(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            max_position_embeddings=4096,
        )

    @classmethod
    def from_hf_dict(cls, config: dict, source: str = "config.json") -> ModelConfig:
        """Read a Hugging Face Llama (or window-less Mistral) `config.json` dictionary;
        `UnsupportedModelError` for anything the model code does not implement."""
        refuse_unsupported(config, source)
        try:
            num_heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            rope_theta, rope_scaling = read_rope(config, source)
            return cls(
                vocab_size=int(config["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]),
                num_layers=int(config["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
                head_dim=int(config.get("head_dim") or hidden // num_heads),
                rope_theta=rope_theta,
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
                rope_scaling=rope_scaling,
                eos_token_ids=token_ids(config.get("eos_token_id")),
            )
        except KeyError as missing:
            raise ModelLoadError(f"{source}: missing key {missing}") from None


def refuse_unsupported(config: dict, source: str) -> None:
    """Raise `UnsupportedModelError` for an architecture or option the model code lacks."""
    if "model_type" not in config:
        raise ModelLoadError(f"{source}: missing key 'model_type'")
    model_type = config["model_type"]
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{source}: model_type {model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if config.get("sliding_window") is not None:
        raise UnsupportedModelError(
            f"{source}: sliding_window={config['sliding_window']} is not supported "
            "(only full causal attention is implemented)"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            raise UnsupportedModelError(f"{source}: {flag}=true is not supported")
    if config.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(
            f"{source}: hidden_act {config['hidden_act']!r} is not supported (only silu)"
        )
    if config.get("quantization_config"):
        raise UnsupportedModelError(f"{source}: quantization_config is not supported")


def read_rope(config: dict, source: str) -> tuple[float, Llama3RopeScaling | None]:
    """`(rope_theta, scaling)` from a config; only default and llama3 rope are implemented."""
    # Older configs keep rope_theta at the top level and variants in rope_scaling; newer
    # ones put both in rope_parameters.
    key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    rope = config.get(key) or {}
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10_000.0)))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(f"{source}: {key}.partial_rotary_factor is not supported")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise UnsupportedModelError(
            f"{source}: {key}.rope_type {kind!r} is not supported (default, llama3)"
        )
    scaling = Llama3RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(
            rope.get("original_max_position_embeddings") or config["max_position_embeddings"]
        ),
    )
    if not scaling.high_freq_factor > scaling.low_freq_factor:
        raise ModelLoadError(f"{source}: {key}.high_freq_factor must exceed low_freq_factor")
    return theta, scaling


def token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    """A config's `eos_token_id` (one id, a list or absent) as a tuple."""
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in fp32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_and_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, fused: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream `x + delta` (`x` where `delta` is None) and its norm. With
        `fused` (see `fused_ops_apply`) one C call does both, adding in place into `x`."""
        if fused:
            return x, add_rms_norm(x, delta, self.weight, self.eps)
        if delta is not None:
            x = x + delta
        return x, self(x)


def rope_frequencies(config: ModelConfig, device: torch.device) -> torch.Tensor:
    """The rotary inverse frequencies `[head_dim / 2]` in fp32, scaled if the config says so."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, device=device).float() / dim))
    if config.rope_scaling is None:
        return inv_freq
    return config.rope_scaling.rescale(inv_freq)


Rotary = tuple[torch.Tensor, torch.Tensor]
"""The cosines and sines `[tokens, 1, head_dim]` of one step's positions (`rotary_tables`)."""


def rotary_tables(config: ModelConfig, positions: torch.Tensor, dtype: torch.dtype) -> Rotary:
    """Cosines and sines of `positions [tokens]` for `rotate`, computed in fp32 and
    rounded to `dtype` once per forward pass (every layer uses the same)."""
    angles = positions.float()[:, None] * rope_frequencies(config, positions.device)[None, :]
    emb = torch.cat((angles, angles), dim=-1)[:, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate(x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    """Apply rotary embeddings to `x [tokens, heads, head_dim]` (Hugging Face's half-split
    layout) with the `rotary_tables` of its tokens' positions."""
    cos, sin = rotary
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(layer, q [T, H, D], k [T, KVH, D], v [T, KVH, D]) -> attention output [T, H, D]."""


class Attention(nn.Module):
    """Grouped-query self-attention projections; the attention itself is passed in."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.config = config
        self.q_proj = PackedLinear(config.hidden_size, q_size)
        self.k_proj = PackedLinear(config.hidden_size, kv_size)
        self.v_proj = PackedLinear(config.hidden_size, kv_size)
        self.o_proj = PackedLinear(q_size, config.hidden_size)
        self.qkv = FusedProjections((self.q_proj, self.k_proj, self.v_proj))

    def forward(
        self, layer: int, x: torch.Tensor, rotary: Rotary, attend: AttentionFn, fused: bool
    ) -> torch.Tensor:
        c = self.config
        heads = self.qkv(x).view(-1, c.num_heads + 2 * c.num_kv_heads, c.head_dim)
        rotated = c.num_heads + c.num_kv_heads  # the query and key heads, rotated as one
        if fused:  # in place, in the product's output
            rotate_heads(heads, rotated, *rotary)
            q, k = heads[:, : c.num_heads], heads[:, c.num_heads : rotated]
        else:
            q, k = rotate(heads[:, :rotated], rotary).split((c.num_heads, c.num_kv_heads), 1)
        v = heads[:, rotated:]
        return self.o_proj(attend(layer, q, k, v).reshape(x.shape[0], -1))


class MLP(nn.Module):
    """SwiGLU feed-forward block."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = PackedLinear(config.hidden_size, config.intermediate_size)
        self.up_proj = PackedLinear(config.hidden_size, config.intermediate_size)
        self.down_proj = PackedLinear(config.intermediate_size, config.hidden_size)
        self.gate_up = FusedProjections((self.gate_proj, self.up_proj))

    def forward(self, x: torch.Tensor, fused: bool) -> torch.Tensor:
        if fused:
            return self.down_proj(silu_and_mul(self.gate_up(x)))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP with residual connections.

    A layer takes the residual stream and the previous layer's MLP output, and returns the
    stream and its own MLP output, so that each residual add is done by the norm after
    it (one fused call where `fused`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        layer: int,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        rotary: Rotary,
        attend: AttentionFn,
        fused: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, h = self.input_layernorm.add_and_norm(x, delta, fused)
        attended = self.self_attn(layer, h, rotary, attend, fused)
        x, h = self.post_attention_layernorm.add_and_norm(x, attended, fused)
        return x, self.mlp(h, fused)


class _Body(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [T, H, D] are the last T of the context k, v [C, KVH, D]; causal.

    torch's fused attention, which never materialises the `[H, T, C]` scores and
    accumulates in fp32 for every input dtype; each KV head serves its group of query
    heads without copying K/V per head. Query `i` sees the keys up to position
    `C - T + i` (all of a cached prefix and of earlier chunks). The inputs get a batch
    dimension: given `[H, T, D]`, torch's CPU dispatch takes its unfused path, which
    does build the scores (ten times slower at 2,600 tokens, with 250 MB of fresh pages).
    """
    num_new, context = q.shape[0], k.shape[0]
    mask = None
    if num_new != context:  # the diagonal sits C - T columns to the right
        mask = torch.ones(num_new, context, dtype=torch.bool, device=q.device).tril(
            context - num_new
        )
    out = nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


@dataclass(frozen=True)
class _ShortChunks:
    """The query rows of a step's short prefill chunks, laid out for the cpu kernel once
    for every layer: each chunk's sequence's blocks as one table row, and per query row
    its table row and its context up to itself."""

    rows: slice | torch.Tensor  # the rows of q; a slice where they are consecutive
    blocks: torch.Tensor  # [chunks, most blocks] int32
    table_rows: torch.Tensor  # [rows] int32
    lens: torch.Tensor  # [rows] int32

    @classmethod
    def of(
        cls,
        chunks: Sequence[tuple[int, torch.Tensor]],
        first_row: int,
        block_size: int,
        device: torch.device,
    ) -> _ShortChunks | None:
        """The short chunks among `chunks` (whose rows start at `first_row`; each
        context's slots laid out in blocks of `block_size`), or None."""
        rows, table_rows, lens, contexts = [], [], [], []
        row = first_row
        for num_new, context in chunks:
            if num_new <= IN_PLACE_CHUNK_TOKENS:
                rows.extend(range(row, row + num_new))
                table_rows.extend([len(contexts)] * num_new)
                lens.extend(range(len(context) - num_new + 1, len(context) + 1))
                contexts.append(context[::block_size] // block_size)
            row += num_new
        if not rows:
            return None
        blocks = torch.zeros(len(contexts), max(map(len, contexts)), dtype=torch.int32)
        for index, context_blocks in enumerate(contexts):
            blocks[index, : len(context_blocks)] = context_blocks
        consecutive = rows[-1] - rows[0] + 1 == len(rows)
        as_tensor = partial(torch.tensor, dtype=torch.int32, device=device)
        return cls(
            slice(rows[0], rows[-1] + 1)
            if consecutive
            else torch.tensor(rows, dtype=torch.long, device=device),
            blocks.to(device),
            as_tensor(table_rows),
            as_tensor(lens),
        )


class LlamaModel(nn.Module):
    """The decoder: token ids in, next-token logits out."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = _Body(config)
        self.lm_head = PackedLinear(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.scale = 1.0 / math.sqrt(config.head_dim)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def _run(
        self, token_ids: torch.Tensor, positions: torch.Tensor, attend: AttentionFn
    ) -> torch.Tensor:
        x = self.model.embed_tokens(token_ids)
        rotary = rotary_tables(self.config, positions, x.dtype)
        fused = fused_ops_apply(x)
        delta = None
        for index, layer in enumerate(self.model.layers):
            x, delta = layer(index, x, delta, rotary, attend, fused)
        return self.model.norm.add_and_norm(x, delta, fused)[1]

    def pack_weights(self) -> None:
        """Make the projections' packed weight copies now (`runtime.linear`), which the first
        forward without autograd otherwise makes: one token through the model."""
        self.forward_dense(torch.zeros(1, dtype=torch.long, device=self.device))

    @torch.inference_mode()
    def forward_dense(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Logits `[T, vocab]` for every position of one sequence, without a cache."""
        positions = torch.arange(token_ids.shape[0], device=token_ids.device)

        def attend(layer, q, k, v):
            return causal_attention(q, k, v, self.scale)

        return self.lm_head(self._run(token_ids, positions, attend)).float()

    @torch.inference_mode()
    def forward_step(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        kv: KVCache,
        *,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
        block_size: int,
        chunks: Sequence[tuple[int, torch.Tensor]],
        logit_rows: torch.Tensor,
        backend: str = "torch",
    ) -> torch.Tensor:
        """Logits `[len(logit_rows), vocab]` of the given rows of one step's new tokens.

        `token_ids`, `positions` and `slots` `[D + C]` list the D decode tokens first
        (`block_table [D, blocks]` and `context_lens [D]` are their sequences'), then
        each prefill chunk's tokens in order; `chunks` gives per chunk its number of new
        tokens and the slots of its sequence's whole context up to its last new token.
        """
        num_decodes = block_table.shape[0]
        c_kernel = backend == "cpu" and kv.k[0].dtype in CPU_DTYPES  # reads blocks in place
        layout = None  # every layer reads the same blocks: lay them out once
        if num_decodes and backend != "triton" and not c_kernel:
            layout = decode_layout(kv.k[0], block_table, context_lens, block_size=block_size)
        short = (
            _ShortChunks.of(chunks, num_decodes, block_size, token_ids.device) if c_kernel else None
        )

        def decode_attention(q, keys, values, layer):
            return paged_attention(
                q,
                keys,
                values,
                block_table,
                context_lens,
                block_size=block_size,
                scale=self.scale,
                backend=backend,
                layout=layout,
                check_values=layer == 0,
            )

        def attend(layer, q, k, v):
            keys, values = kv.k[layer], kv.v[layer]
            # The slots are the same for every layer: checked once, in the first.
            write_kv(keys, values, k, v, slots, backend=backend, check_slots=layer == 0)
            if not chunks:  # decodes only: the kernel's output is the whole output
                return decode_attention(q, keys, values, layer)
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            if num_decodes:
                out[:num_decodes] = decode_attention(q[:num_decodes], keys, values, layer)
            if short is not None:
                out[short.rows] = paged_attention_cpu(
                    q[short.rows],
                    keys,
                    values,
                    short.blocks,
                    short.lens,
                    block_size=block_size,
                    scale=self.scale,
                    table_rows=short.table_rows,
                )
            row = num_decodes
            for num_new, context in chunks:
                if short is None or num_new > IN_PLACE_CHUNK_TOKENS:
                    chunk = q[row : row + num_new]
                    out[row : row + num_new] = causal_attention(
                        chunk, keys[context], values[context], self.scale
                    )
                row += num_new
            return out

        hidden = self._run(token_ids, positions, attend)
        return self.lm_head(hidden[logit_rows]).float()
