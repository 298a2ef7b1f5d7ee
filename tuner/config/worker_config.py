"""What `blocktune worker` runs with, resolved once: flags over the policy over the defaults.

One object is handed down from the command line to the engine and the HTTP
server, as vLLM hands down its `VllmConfig`: the KV pool and the starting block
size come from the policy's `kv_budget` and `starting_block_size` (the sizes the
sidecar deciding for this worker assumes), its candidates, token variable and
connection limits likewise, and a flag given on the command line wins.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from blocktune.tuner.config.defaults import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CANDIDATES,
    DEFAULT_KV_BYTES,
    DEFAULT_TOKEN_ENV,
)
from blocktune.tuner.config.policy import Policy, ServerSettings

__all__ = ["PoolSettings", "WorkerConfig", "worker_config"]


@dataclass(frozen=True)
class PoolSettings:
    """The KV pool and the block sizes of one worker: bytes, starting size, swap candidates."""

    kv_bytes: int
    block_size: int
    candidates: tuple[int, ...]


@dataclass(frozen=True)
class WorkerConfig:
    """A worker's pool, the variable of its admin token and its HTTP server's limits and
    allowed hosts."""

    pool: PoolSettings
    token_env: str = DEFAULT_TOKEN_ENV
    server: ServerSettings = field(default_factory=ServerSettings)


def worker_config(
    policy: Policy | None,
    *,
    kv_bytes: int | None = None,
    block_size: int | None = None,
    candidates: list[int] | None = None,
    token_env: str | None = None,
    allowed_hosts: list[str] | None = None,
) -> WorkerConfig:
    """The worker's settings: each given value, else the policy's, else the default."""
    server = policy.server if policy is not None else ServerSettings()
    if allowed_hosts is not None:
        server = server.model_copy(update={"allowed_hosts": tuple(allowed_hosts)})
    if policy is None:
        pool = PoolSettings(
            kv_bytes=kv_bytes or DEFAULT_KV_BYTES,
            block_size=block_size or DEFAULT_BLOCK_SIZE,
            candidates=tuple(candidates or DEFAULT_CANDIDATES),
        )
        return WorkerConfig(pool, token_env or DEFAULT_TOKEN_ENV, server)
    pool = PoolSettings(
        kv_bytes=kv_bytes or int(policy.kv_budget),
        block_size=block_size or policy.starting_block_size,
        candidates=tuple(candidates or policy.candidates),
    )
    return WorkerConfig(pool, token_env or policy.auth.token_env, server)
