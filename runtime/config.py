"""The engine's configuration: KV pool, batch limits, attention backend and swap candidates."""

from __future__ import annotations

from dataclasses import dataclass

from blocktune.kernels import is_power_of_two
from blocktune.kernels.paged_attention import BACKENDS
from blocktune.runtime.defaults import DEFAULT_BLOCK_SIZE, DEFAULT_CANDIDATES

__all__ = ["EngineConfig"]


@dataclass(frozen=True)
class EngineConfig:
    """Pool size, batch limits and attention backend.

    Give the pool as `num_blocks` (at `block_size`) or as `kv_bytes`; the pool
    is a fixed number of token slots, so a later block-size change keeps it.
    `max_model_len` defaults to the model's `max_position_embeddings` and
    `attention_backend` to `default_backend` of its device (on a CPU the C kernel
    that reads the blocks in place, where it builds). `max_num_batched_tokens`
    bounds the tokens one step computes (decodes and prefill chunks together);
    None computes every admitted prompt whole. It must cover `max_num_seqs`
    decodes, and it excludes prefix caching (a preempted partial prefill would
    leave cached blocks without their K/V).
    """

    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int | None = None
    kv_bytes: int | None = None
    max_num_seqs: int = 32
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    attention_backend: str | None = None  # None: `default_backend` of the model's device
    enable_prefix_caching: bool = False
    candidate_block_sizes: tuple[int, ...] = DEFAULT_CANDIDATES
    swap_staging_bytes: int = 64 * 2**20

    def __post_init__(self) -> None:
        if (self.num_blocks is None) == (self.kv_bytes is None):
            raise ValueError("give exactly one of num_blocks and kv_bytes")
        if self.attention_backend not in (*BACKENDS, None):
            raise ValueError(
                f"attention_backend must be one of {BACKENDS}, got {self.attention_backend!r}"
            )
        for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_num_batched_tokens is not None:
            if self.max_num_batched_tokens < self.max_num_seqs:
                raise ValueError(
                    f"max_num_batched_tokens {self.max_num_batched_tokens} is below "
                    f"max_num_seqs {self.max_num_seqs}: a step could not decode every row"
                )
            if self.enable_prefix_caching:
                raise ValueError(
                    "max_num_batched_tokens (chunked prefill) cannot be combined with "
                    "enable_prefix_caching"
                )
        bad = [b for b in self.candidate_block_sizes if not is_power_of_two(b)]
        if bad:
            raise ValueError(f"candidate block sizes must be powers of two, got {bad}")
        if self.block_size not in self.candidate_block_sizes:
            raise ValueError(
                f"block_size {self.block_size} is not among the candidate block sizes "
                f"{self.candidate_block_sizes}"
            )
