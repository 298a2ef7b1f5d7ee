"""What blocktune's long-running services share outside HTTP: log lines and the bearer token.

The sidecar library and the HTTP surfaces both log structured events and read
their token from the environment; neither needs FastAPI for that.
"""

from __future__ import annotations

import json
import logging
import os
import time

__all__ = ["log_event", "token_from_env"]


def token_from_env(name: str | None) -> str | None:
    """The token in environment variable `name`, or None when unnamed, unset or empty."""
    if not name:
        return None
    return os.environ.get(name) or None


def log_event(
    logger: logging.Logger, event: str, *, level: int = logging.INFO, **fields: object
) -> None:
    """One structured log line at `level`: `{"ts": ..., "event": ..., **fields}` as JSON."""
    line = json.dumps({"ts": round(time.time(), 3), "event": event, **fields}, default=str)
    logger.log(level, line)
