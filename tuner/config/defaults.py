"""The defaults every part of blocktune shares, each named once.

Like vLLM's ``CacheConfig.DEFAULT_BLOCK_SIZE``: a command, a policy field or a
report that needs one of these imports it from here instead of typing it again.
The engine's own defaults are the runtime's (`blocktune.runtime.defaults`),
re-exported here.
"""

from __future__ import annotations

from blocktune.runtime.defaults import DEFAULT_BLOCK_SIZE, DEFAULT_CANDIDATES, DEFAULT_KV_BYTES

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_CANDIDATES",
    "DEFAULT_DAY_RATE_SCALE",
    "DEFAULT_KV_BYTES",
    "DEFAULT_POLICY",
    "DEFAULT_TOKEN_ENV",
    "SYNTHETIC_TRACE",
]

DEFAULT_TOKEN_ENV = "BLOCKTUNE_TOKEN"
"""The environment variable holding the bearer token of the mutating HTTP endpoints."""

DEFAULT_POLICY = "default"
"""The bundled policy used when a command is given none (``policies/default.yaml``)."""

SYNTHETIC_TRACE = "synthetic"
"""The trace name that stands for the embedded synthetic customer-service day."""

DEFAULT_DAY_RATE_SCALE = 0.05
"""The embedded day's arrival-rate multiplier in replays: about 8000 requests, a few seconds."""
