"""What `blocktune worker` runs with, resolved once: flags over the policy over the defaults.

One object is handed down from the command line to the engine and the HTTP
server, as vLLM hands down its `VllmConfig`: the engine's configuration (the
policy's engine settings, `tuner.config.engine_settings`, those the sidecar
deciding for this worker simulates), the variable of the admin token and the
server's connection limits; a flag given on the command line wins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from blocktune.tuner.config.defaults import DEFAULT_TOKEN_ENV
from blocktune.tuner.config.engine_settings import engine_settings
from blocktune.tuner.config.policy import Policy, ServerSettings

if TYPE_CHECKING:
    from blocktune.runtime.config import EngineConfig

__all__ = ["WorkerConfig", "worker_config"]


@dataclass(frozen=True)
class WorkerConfig:
    """A worker's engine configuration, the variable of its admin token (None: no token)
    and its HTTP server's limits and allowed hosts."""

    engine: EngineConfig
    token_env: str | None
    server: ServerSettings


def worker_config(
    policy: Policy | None,
    *,
    token_env: str | None = None,
    allowed_hosts: list[str] | None = None,
    **engine: Any,
) -> WorkerConfig:
    """The worker's settings: each given value, else the policy's, else the default;
    `engine` are the engine settings given (`engine_settings`' keywords, None: not given).
    Raises ValueError for an engine configuration blocktune's engine refuses."""
    server = policy.server if policy is not None else ServerSettings()
    if allowed_hosts is not None:
        server = server.model_copy(update={"allowed_hosts": tuple(allowed_hosts)})
    if token_env is None:
        token_env = policy.auth.token_env if policy is not None else DEFAULT_TOKEN_ENV
    return WorkerConfig(engine_settings(policy, **engine).engine_config(), token_env, server)
