"""vLLM as the sidecar's child, restarted with a new block size for each switch.

`VllmProcessActuator` runs the server itself (its own process group, output
read line by line for the platform and attention backend vLLM logs, e.g.
"device_config=cpu" and "Using FLASH_ATTN attention backend", and
appended to `log_file` when one is set). A switch drains (`POST /pause?mode=wait`
where the server has that route, else it waits until `/metrics` counts no
running or waiting request, up to `drain_timeout`), stops (SIGTERM to the
group, SIGKILL after `stop_timeout`), starts the new size and waits for
`/health`. A server that exits first, or is not healthy within
`start_timeout`, is stopped and the old size started again: the switch is
`rolled_back` with vLLM's last error line as the reason, and the size is
remembered as refused, so later decisions that want it again are `rejected` at
once instead of restarting vLLM every interval. If the old size does not come
back either, the switch `failed`, the actuator reports the server down and
restarts nothing more on its own (no crash loop): an operator looks.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

import httpx

from blocktune.tuner.config.vllm_backends import BACKEND_LINE, PLATFORM_LINE
from blocktune.tuner.operations import NotReady, log_event, wait_until_ready
from blocktune.tuner.sidecar.actuators import STATE_TIMEOUT_S, Actuation
from blocktune.tuner.sidecar.restarts import fill_block_size, reason_from, requests_in_flight

__all__ = ["EngineInfoSink", "VllmProcessActuator"]

log = logging.getLogger("blocktune.sidecar")

LOG_TAIL_LINES = 1000
"""Lines of a server's output kept for the reason of a failed start (vLLM's root cause comes
a few hundred lines of tracebacks before it exits)."""
DRAIN_POLL_S = 0.25

EngineInfoSink = Callable[[str | None, str | None], None]
"""Told (platform, attention backend) as the server's log reveals them."""


class _OutputReader:
    """Reads a child's output in a thread: keeps the tail, copies it to a file, and tells
    the platform and attention backend the log names."""

    def __init__(self, stream: IO[str], log_file: Path | None, on_info: EngineInfoSink) -> None:
        self.tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
        self._stream = stream
        self._log_file = log_file
        self._on_info = on_info
        self._thread = threading.Thread(target=self._run, name="vllm-output", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sink = None
        if self._log_file is not None:
            try:
                sink = self._log_file.open("a", encoding="utf-8")
            except OSError as error:
                log_event(
                    log, "vllm_log_file_unwritable", file=str(self._log_file), error=str(error)
                )
        try:
            for line in self._stream:
                self.tail.append(line.rstrip("\n"))
                if sink is not None:
                    sink.write(line)
                    sink.flush()
                if match := PLATFORM_LINE.search(line):
                    self._on_info(match.group(1), None)
                if match := BACKEND_LINE.search(line):
                    self._on_info(None, match.group(1))
        except (OSError, ValueError):  # the pipe closed under us at shutdown
            pass
        finally:
            if sink is not None:
                sink.close()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)


class VllmProcessActuator:
    """Runs a vLLM server as a child and restarts it with a new block size (module docstring)."""

    def __init__(
        self,
        command: Sequence[str],
        url: str,
        *,
        initial_block_size: int,
        drain_timeout_s: float = 30.0,
        start_timeout_s: float = 300.0,
        stop_timeout_s: float = 30.0,
        log_file: Path | str | None = None,
        on_engine_info: EngineInfoSink | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.command = list(command)
        self.url = url.rstrip("/")
        self.drain_timeout_s = drain_timeout_s
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.log_file = None if log_file is None else Path(log_file)
        self.refused: dict[int, str] = {}
        """Sizes that did not come up, with why: asked again, they are rejected at once."""
        self._on_info = on_engine_info or (lambda _platform, _backend: None)
        self._env = env
        self._client = httpx.Client(timeout=STATE_TIMEOUT_S)
        self._lock = threading.Lock()
        self._size = initial_block_size
        self._process: subprocess.Popen | None = None
        self._reader: _OutputReader | None = None
        self._starting: threading.Thread | None = None
        self._down: str | None = None  # why the server is down after a failed rollback

    @property
    def target(self) -> str:
        return f"vllm process at {self.url}"

    def start(self) -> None:
        """Start the server with the initial size; its wait for /health runs in a thread."""
        with self._lock:
            if self._process is not None or self._starting is not None:
                return
            self._starting = threading.Thread(
                target=self._first_start, name="vllm-start", daemon=True
            )
            self._starting.start()

    def _first_start(self) -> None:
        with self._lock:
            problem = self._start(self._size)
            if problem is not None:
                self._down = problem
                log_event(log, "vllm_start_failed", block_size=self._size, reason=problem)

    @property
    def down_reason(self) -> str | None:
        """Why the server is down for good (its first start, or a rollback, failed), or None."""
        return self._down

    def block_size(self) -> int | None:
        """The size the running server was started with, when it answers /health now."""
        process = self._process
        if process is None or process.poll() is not None:
            return None
        try:
            healthy = self._client.get(f"{self.url}/health").status_code == 200
        except httpx.HTTPError:
            return None
        return self._size if healthy else None

    def apply(self, new_block_size: int, old_block_size: int) -> Actuation:
        """Drain, stop, start `new_block_size`, roll back on failure; never raises."""
        self._settle_first_start()
        with self._lock:
            old = self._size
            if self._down is not None:
                return self._outcome(
                    "failed", old, new_block_size, f"vLLM is down: {self._down}", 0.0
                )
            if self._process is None or self._process.poll() is not None:
                code = None if self._process is None else self._process.returncode
                reason = f"vLLM is not running (exit code {code}); nothing restarts it on its own"
                return self._outcome("failed", old, new_block_size, reason, 0.0)
            if new_block_size in self.refused:
                earlier = self.refused[new_block_size]
                reason = f"vLLM did not start with {new_block_size} before: {earlier}"
                return self._outcome("rejected", old, new_block_size, reason, 0.0)
            drain_note = self._drain()
            began = time.monotonic()
            self._stop()
            problem = self._start(new_block_size)
            elapsed = time.monotonic() - began
            if problem is None:
                return self._outcome("done", old, new_block_size, drain_note, elapsed)
            self.refused[new_block_size] = problem
            log_event(log, "vllm_block_size_refused", block_size=new_block_size, reason=problem)
            back = self._start(old)
            elapsed = time.monotonic() - began
            if back is None:
                return self._outcome("rolled_back", old, new_block_size, problem, elapsed)
            self._down = f"the old size {old} did not come back either: {back}"
            reason = f"{problem}; then {self._down}"
            return self._outcome("failed", old, new_block_size, reason, elapsed)

    def _settle_first_start(self) -> None:
        starting = self._starting
        if starting is not None:
            starting.join()

    def _outcome(self, status: str, old: int, new: int, reason: str, pause_s: float) -> Actuation:
        in_force = new if status == "done" else old
        log_event(
            log,
            "vllm_restart",
            status=status,
            old_block_size=old,
            new_block_size=new,
            block_size_in_force=in_force,
            restart_s=round(pause_s, 3),
            reason=reason,
        )
        return Actuation(
            status,
            old,
            new,
            pause_s=pause_s,
            reason=reason,
            target=self.target,
            at=time.time(),
        )

    def _drain(self) -> str:
        """Wait for in-flight requests (up to the drain timeout); a note when some remained."""
        deadline = time.monotonic() + self.drain_timeout_s
        with contextlib.suppress(httpx.HTTPError):
            paused = self._client.post(
                f"{self.url}/pause", params={"mode": "wait"}, timeout=self.drain_timeout_s
            )
            if paused.status_code == 200:
                return ""
        left = None
        while True:
            try:
                left = requests_in_flight(self._client.get(f"{self.url}/metrics").text)
            except (httpx.HTTPError, ValueError):
                left = None
            if left == 0:
                return ""
            if time.monotonic() >= deadline:
                break
            time.sleep(DRAIN_POLL_S)
        counted = "an unknown number of" if left is None else str(left)
        note = (
            f"{counted} requests were still in flight after the drain timeout "
            f"({self.drain_timeout_s:g} s); stopped anyway"
        )
        log_event(log, "vllm_drain_timeout", in_flight=left, drain_timeout_s=self.drain_timeout_s)
        return note

    def _start(self, block_size: int) -> str | None:
        """Start the server with `block_size` and wait for /health: None, or why not."""
        argv = fill_block_size(self.command, block_size)
        began = time.monotonic()
        try:
            process = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
                errors="replace",
                start_new_session=True,
                env=self._env,
            )
        except OSError as error:
            return f"cannot run {argv[0]}: {error.strerror or error}"
        self._process = process
        self._reader = _OutputReader(process.stdout, self.log_file, self._on_info)
        try:
            wait_until_ready(self.url, process, timeout_s=self.start_timeout_s, path="/health")
        except NotReady as error:
            self._stop()
            return reason_from(str(error), list(self._reader.tail))
        self._size = block_size
        self._down = None
        log_event(
            log,
            "vllm_serving",
            block_size=block_size,
            pid=process.pid,
            start_s=round(time.monotonic() - began, 3),
        )
        return None

    def _stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL it after the stop timeout."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            self._signal(process, signal.SIGTERM)
            try:
                process.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                log_event(
                    log, "vllm_stop_timeout", pid=process.pid, stop_timeout_s=self.stop_timeout_s
                )
                self._signal(process, signal.SIGKILL)
                process.wait()
        self._signal(process, signal.SIGKILL)  # whatever the group left behind
        if self._reader is not None:
            self._reader.join(self.stop_timeout_s)
        if process.stdout is not None:
            process.stdout.close()

    @staticmethod
    def _signal(process: subprocess.Popen, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signum)

    def close(self) -> None:
        """Stop the server (the sidecar's shutdown stops what it started)."""
        self._settle_first_start()
        with self._lock:
            self._stop()
            self._process = None
        self._client.close()
