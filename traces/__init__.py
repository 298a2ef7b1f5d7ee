"""Request traces: loaders for public formats and seeded synthetic workloads.

Every loader and generator produces the canonical request table described in
`blocktune.traces.schema`. The names below are imported on first use, so
importing a light submodule (such as `blocktune.traces.formats`) does not load
pandas.
"""

from __future__ import annotations

import importlib
from types import MappingProxyType

_EXPORTS = MappingProxyType(
    {
        "FORMATS": "formats",
        "PREFIX_BLOCK_TOKENS": "schema",
        "TraceError": "schema",
        "LoadedTrace": "loaders",
        "load_trace": "loaders",
        "write_trace": "writers",
        "Phase": "synth",
        "WorkloadError": "synth",
        "CUSTOMER_SERVICE_PHASES": "synth",
        "customer_service_day": "synth",
    }
)

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
