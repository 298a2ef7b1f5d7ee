"""What blocktune's long-running services share outside HTTP: log lines, the bearer token,
and starting one of them as a child process.

The sidecar library and the HTTP surfaces both log structured events and read
their token from the environment; neither needs FastAPI for that. The demo, the
benchmarks and the tests start services as processes on loopback and wait until
they answer (`free_port`, `wait_until_ready`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import time

__all__ = ["NotReady", "free_port", "log_event", "token_from_env", "wait_until_ready"]

READY_POLL_S = 0.1
"""How often `wait_until_ready` asks a starting service."""


class NotReady(RuntimeError):
    """A started service exited, or did not answer 200 in time."""


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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_ready(
    url: str, process: subprocess.Popen, *, timeout_s: float, path: str = "/healthz"
) -> None:
    """Return once `url + path` answers 200; raise `NotReady` when `process` exits first or
    `timeout_s` passes."""
    import httpx

    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=1) as client:  # one client: each new one costs ~35 ms of CPU
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise NotReady(f"{url} exited with code {process.returncode} before it was ready")
            with contextlib.suppress(httpx.HTTPError):  # not listening yet: poll again
                if client.get(f"{url}{path}").status_code == 200:
                    return
            time.sleep(READY_POLL_S)
    raise NotReady(f"{url}{path} did not answer 200 within {timeout_s:.0f} s")
