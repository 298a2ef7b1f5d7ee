"""A user's command (a systemd unit, a Kubernetes rollout) that restarts the engine with a new size.

`CommandActuator` runs the script to completion within `timeout`, then, when
the server's `url` is known, waits for `/health`; a non-zero exit, a timeout or
no health means running it again with the old size: the switch is
`rolled_back`, and the size is remembered as refused.

The script runs in its own process group and is judged by its exit status: a
background child it leaves (a server it started) neither delays nor fails it,
since its output goes to a temporary file, not a pipe someone else may hold.
On a timeout the whole group is stopped (SIGTERM, then SIGKILL after
`KILL_GRACE_S`), so no rollout carries on beside the rollback.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import IO

import httpx

from blocktune.tuner.operations import log_event
from blocktune.tuner.sidecar.actuators import STATE_TIMEOUT_S, Actuation
from blocktune.tuner.sidecar.restarts import HEALTH_POLL_S, fill_block_size, reason_from
from blocktune.tuner.sidecar.vllm_metrics import parse_exposition

__all__ = ["KILL_GRACE_S", "CommandActuator"]

log = logging.getLogger("blocktune.sidecar")

KILL_GRACE_S = 5.0
"""How long a timed-out script's group has after SIGTERM before SIGKILL."""
OUTPUT_TAIL_BYTES = 64 * 1024
"""How much of a failed script's output its reason is read from (the end)."""
CHILD_POLL_S = 0.1
"""How often a running script is checked for its exit (and the sidecar for its stop)."""


class CommandActuator:
    """Runs a user's command with `{block_size}` to apply a switch (module docstring)."""

    def __init__(
        self,
        command: Sequence[str],
        *,
        url: str | None = None,
        timeout_s: float = 90.0,
        start_timeout_s: float = 300.0,
    ) -> None:
        self.command = list(command)
        self.url = None if url is None else url.rstrip("/")
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self.refused: dict[int, str] = {}
        self._client = httpx.Client(timeout=STATE_TIMEOUT_S)
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._size: int | None = None

    @property
    def target(self) -> str:
        return f"command {self.command[0]}"

    def start(self) -> None:
        """Nothing to start: the command's service runs on its own."""

    def block_size(self) -> int | None:
        """The server's size from its `/metrics` when the url is known, else the size of the
        last run that succeeded (None before one)."""
        if self.url is None:
            return self._size
        try:
            response = self._client.get(f"{self.url}/metrics")
            response.raise_for_status()
            sizes = parse_exposition(response.text).block_sizes
        except (httpx.HTTPError, ValueError):
            return None
        return sizes[0] if sizes else None

    def apply(self, new_block_size: int, old_block_size: int) -> Actuation:
        """Run the command for the new size, and for the old one when that fails."""
        with self._lock:
            old = old_block_size
            if new_block_size in self.refused:
                earlier = self.refused[new_block_size]
                reason = f"the command failed for {new_block_size} before: {earlier}"
                return self._outcome("rejected", old, new_block_size, reason, 0.0)
            began = time.monotonic()
            problem = self._run(new_block_size)
            if problem is None:
                self._size = new_block_size
                return self._outcome("done", old, new_block_size, "", time.monotonic() - began)
            if self._closing.is_set():  # no refusal and no rollback on the way out
                return self._outcome("failed", old, new_block_size, problem, 0.0)
            self.refused[new_block_size] = problem
            back = self._run(old)
            elapsed = time.monotonic() - began
            if back is None:
                self._size = old
                return self._outcome("rolled_back", old, new_block_size, problem, elapsed)
            reason = f"{problem}; then the old size {old} failed too: {back}"
            return self._outcome("failed", old, new_block_size, reason, elapsed)

    def _run(self, block_size: int) -> str | None:
        argv = fill_block_size(self.command, block_size)
        with tempfile.TemporaryFile() as output:
            try:
                child = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as error:
                return f"cannot run {argv[0]}: {error.strerror or error}"
            deadline = time.monotonic() + self.timeout_s
            while (code := child.poll()) is None:
                if self._closing.is_set():
                    return f"the sidecar is stopping; {argv[0]} is left to finish on its own"
                if time.monotonic() >= deadline:
                    stop_group(child)
                    return f"{argv[0]} did not finish within {self.timeout_s:g} s"
                self._closing.wait(CHILD_POLL_S)
            if code != 0:
                return reason_from(f"{argv[0]} exited with code {code}", output_tail(output))
        return None if self.url is None else self._wait_for_health()

    def _wait_for_health(self) -> str | None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._closing.is_set():
                return "the sidecar is stopping"
            with contextlib.suppress(httpx.HTTPError):
                if self._client.get(f"{self.url}/health").status_code == 200:
                    return None
            self._closing.wait(HEALTH_POLL_S)
        return f"{self.url}/health did not answer 200 within {self.start_timeout_s:g} s"

    def _outcome(self, status: str, old: int, new: int, reason: str, pause_s: float) -> Actuation:
        log_event(
            log,
            "command_switch",
            status=status,
            old_block_size=old,
            new_block_size=new,
            seconds=round(pause_s, 3),
            reason=reason,
        )
        return Actuation(
            status, old, new, pause_s=pause_s, reason=reason, target=self.target, at=time.time()
        )

    def close(self) -> None:
        """End a switch in progress within a poll (a script still running is left to finish
        on its own, with no rollback), then close the HTTP client."""
        self._closing.set()
        with self._lock:
            self._client.close()


def stop_group(child: subprocess.Popen) -> None:
    """Stop the child's process group: SIGTERM, then SIGKILL to whatever is left of it once
    the child has exited or `KILL_GRACE_S` has passed."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=KILL_GRACE_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)
    child.wait()


def output_tail(output: IO[bytes]) -> list[str]:
    """The last lines of a script's output file (at most `OUTPUT_TAIL_BYTES`)."""
    size = output.seek(0, os.SEEK_END)
    output.seek(max(0, size - OUTPUT_TAIL_BYTES))
    return output.read().decode(errors="replace").strip().splitlines()
