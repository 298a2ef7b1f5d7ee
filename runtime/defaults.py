"""The engine's defaults, each named once; the tuner re-exports them (`tuner.config.defaults`)."""

from __future__ import annotations

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_CANDIDATES",
    "DEFAULT_GATHER_S",
    "DEFAULT_KV_BYTES",
    "ENGINE_DTYPES",
    "ENGINE_DTYPE_BYTES",
    "GATHER_LIMIT_S",
]

DEFAULT_BLOCK_SIZE = 16
"""vLLM's default block size: where a deployment starts and what replays compare against."""

DEFAULT_CANDIDATES = (8, 16, 32, 64, 128)
"""The block sizes a swap may choose (and a policy chooses among) when none are named."""

DEFAULT_KV_BYTES = 64 * 2**20
"""The worker's KV pool when neither a flag nor a policy sizes it."""

ENGINE_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
"""The weight and KV dtypes the engine runs in, by torch's names, and the bytes of one
element of each."""

ENGINE_DTYPES = tuple(ENGINE_DTYPE_BYTES)
"""Their names, in that order."""

DEFAULT_GATHER_S = 0.0
"""How long an idle engine loop waits for a burst's next request before its first step: not
at all by default. Gathering prefills a burst in one step, which shortens its time to first
token, but it also keeps the burst's requests in step, so that requests arriving as others
finish come in waves too: on the vs_vllm chat workload 5 ms took TTFT p50 at 32 clients
from 0.365-0.402 s to 0.351-0.360 s and at 8 from 0.109-0.135 s to 0.129-0.150 s."""

GATHER_LIMIT_S = 0.05
"""The longest an idle engine loop gathers a burst, however closely its requests follow."""
