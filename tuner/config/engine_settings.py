"""The engine a policy deploys, decided once: what is given over the policy over the defaults.

The worker (`blocktune worker`), `blocktune validate`, the demo, the replays, the engine
measurements and the simulator all take an engine's settings from `engine_settings`, so
the simulator prices the engine the worker runs: the same KV pool (the policy's
`kv_budget`), starting block size (`server.initial_block_size`, else the candidate
nearest `DEFAULT_BLOCK_SIZE`), candidates, batch limits (`batch.max_num_seqs`,
`batch.max_num_batched_tokens`) and prefix cache (`batch.enable_prefix_caching`). A
value given (a command-line flag, or a caller's own pool or batch) replaces the policy's
for that setting alone; without a policy every setting not given takes its default.

`EngineSettings.engine_config` is blocktune's `EngineConfig` of the settings (imported
there: the settings themselves load no torch, so the command line can show them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from blocktune.tuner.config.defaults import DEFAULT_BLOCK_SIZE, DEFAULT_CANDIDATES, DEFAULT_KV_BYTES
from blocktune.tuner.config.policy import (
    BatchSettings,
    Policy,
    ServerSettings,
    nearest_power_of_two,
)

if TYPE_CHECKING:
    from blocktune.runtime.config import EngineConfig

__all__ = ["DEFAULT_ENGINE", "ENGINE_BATCH_DEFAULTS", "EngineSettings", "engine_settings"]

DEFAULT_ENGINE: str = Policy.model_fields["engine"].default
"""The engine of a policy that names none: the settings without a policy are its."""

ENGINE_BATCH_DEFAULTS = {"blocktune": (64, None), "vllm": (256, 2048)}
"""(max_num_seqs, max_num_batched_tokens) where neither the policy nor a flag gives them:
blocktune's worker runs 64 rows and prefills whole prompts; vLLM's scheduler defaults to
256 sequences and chunks prefill at 2048 tokens per step (its online-serving default)."""


@dataclass(frozen=True)
class EngineSettings:
    """One engine's pool, block sizes, batch limits, prefix cache and attention backend.

    The pool is `kv_bytes`, or `num_blocks` blocks of `block_size` where a caller sizes it
    so (then `kv_bytes` is None). `candidates` hold `block_size`. `max_model_len` None is
    the model's positions, `attention_backend` None the model's device's default backend.
    """

    engine: str
    kv_bytes: int | None
    num_blocks: int | None
    block_size: int
    candidates: tuple[int, ...]
    max_num_seqs: int
    max_num_batched_tokens: int | None
    enable_prefix_caching: bool
    max_model_len: int | None = None
    attention_backend: str | None = None

    def engine_config(self) -> EngineConfig:
        """blocktune's `EngineConfig` of these settings (ValueError for another engine's,
        or for settings it refuses)."""
        from blocktune.runtime.config import EngineConfig

        if self.engine != "blocktune":
            raise ValueError(
                f"the policy models engine {self.engine}: blocktune's engine runs the "
                "policies of engine: blocktune"
            )
        return EngineConfig(
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            kv_bytes=self.kv_bytes,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            attention_backend=self.attention_backend,
            enable_prefix_caching=self.enable_prefix_caching,
            candidate_block_sizes=self.candidates,
        )


def engine_settings(
    policy: Policy | None,
    *,
    kv_bytes: int | None = None,
    num_blocks: int | None = None,
    block_size: int | None = None,
    candidates: tuple[int, ...] | list[int] | None = None,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    enable_prefix_caching: bool | None = None,
    max_model_len: int | None = None,
    attention_backend: str | None = None,
) -> EngineSettings:
    """The engine's settings: each value given (not None), else the policy's, else the
    default. The pool is `num_blocks` where given, else `kv_bytes`, else the policy's KV
    budget, else `DEFAULT_KV_BYTES`. The starting size is `block_size`, else the policy's
    `server.initial_block_size`, else the candidate nearest `DEFAULT_BLOCK_SIZE`, and is
    added to the candidates. The prefix cache is on unless turned off, except where
    blocktune's engine chunks prefill (it cannot combine the two; vLLM can)."""
    if policy is None:
        engine, budget, listed = DEFAULT_ENGINE, DEFAULT_KV_BYTES, DEFAULT_CANDIDATES
        batch, server = BatchSettings(), ServerSettings()
    else:
        engine, budget, listed = policy.engine, int(policy.kv_budget), policy.candidates
        batch, server = policy.batch, policy.server
    candidates = tuple(_first(candidates, listed))
    nearest = nearest_power_of_two(DEFAULT_BLOCK_SIZE, candidates)
    block_size = _first(block_size, server.initial_block_size, nearest)
    seqs, tokens = ENGINE_BATCH_DEFAULTS[engine]
    tokens = _first(max_num_batched_tokens, batch.max_num_batched_tokens, tokens)
    prefix = engine == "vllm" or tokens is None
    return EngineSettings(
        engine=engine,
        kv_bytes=_first(kv_bytes, budget) if num_blocks is None else None,
        num_blocks=num_blocks,
        block_size=block_size,
        candidates=tuple(sorted({*candidates, block_size})),
        max_num_seqs=_first(max_num_seqs, batch.max_num_seqs, seqs),
        max_num_batched_tokens=tokens,
        enable_prefix_caching=_first(enable_prefix_caching, batch.enable_prefix_caching, prefix),
        max_model_len=max_model_len,
        attention_backend=attention_backend,
    )


def _first(*values):
    """The first of `values` that is not None (None where all are)."""
    return next((value for value in values if value is not None), None)
