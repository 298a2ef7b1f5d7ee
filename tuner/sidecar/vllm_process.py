"""vLLM as the sidecar's child, restarted with a new block size for each switch.

`VllmProcessActuator` runs the server itself (its own process group; its output read
line by line by `vllm_output.OutputReader` for the platform and attention backend
vLLM logs, and appended to `log_file` when one is set). A switch drains
(`POST /pause?mode=wait` where the server has that route, else it waits until
`/metrics` counts no running or waiting request, up to `drain_timeout`, or until the
server exits), stops (SIGTERM to the group, SIGKILL after `stop_timeout`), starts the
new size and waits for `/health`. A server that exits first, or is not healthy within
`start_timeout`, is stopped and the old size started again: the switch is
`rolled_back` with vLLM's last error line as the reason, and the size is refused for
`refusal_ttl`, so later decisions that want it again are `rejected` at once instead
of restarting vLLM every interval. If the old size does not come back either, the
switch `failed` and the actuator reports the server down: an operator looks.

Never two servers: the server is recorded (`child_record`) the moment it starts, so
a sidecar started after a crash adopts the server the last one left running (once it
answers `/health`, at the block size its `/metrics` reports in
`vllm:cache_config_info`), or stops it when it does not come up or was started from
another command. Anything else answering on the port is an error that names it; the
actuator starts nothing there.

A server that exits between switches is noticed within `WATCH_POLL_S`
(`vllm_exited`, with its exit code) and started again after each of the
`restart_delays_s` in turn; one that exits more often within `RESTART_WINDOW_S`
stays down with the reason. `close` stops within about `stop_timeout`: it interrupts
a start, a drain or a back-off in progress and leaves no server behind.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from blocktune.tuner.config.policy import DEFAULT_REFUSAL_TTL
from blocktune.tuner.operations import log_event
from blocktune.tuner.sidecar.actuators import STATE_TIMEOUT_S, Actuation
from blocktune.tuner.sidecar.child_process import ServerProcess, listening_pid
from blocktune.tuner.sidecar.child_record import ChildRecord, RecordedServer
from blocktune.tuner.sidecar.restarts import (
    HEALTH_POLL_S,
    fill_block_size,
    reason_from,
    requests_in_flight,
)
from blocktune.tuner.sidecar.vllm_metrics import parse_exposition
from blocktune.tuner.sidecar.vllm_output import EngineInfoSink, OutputReader

__all__ = ["REFUSAL_TTL_S", "RESTART_DELAYS_S", "VllmProcessActuator"]

log = logging.getLogger("blocktune.sidecar")

DRAIN_POLL_S = 0.25
WATCH_POLL_S = 1.0
"""How often the server is checked for an exit between switches."""
RESTART_DELAYS_S = (1.0, 10.0, 60.0)
"""The back-off before each restart of a server that exited; one more exit within
`RESTART_WINDOW_S` leaves it down."""
RESTART_WINDOW_S = 600.0
REFUSAL_TTL_S = DEFAULT_REFUSAL_TTL.total_seconds()
PORT_CHECK_S = 1.0
STOPPING = "the sidecar is stopping"


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
        on_block_size: Callable[[int], None] | None = None,
        record_file: Path | str | None = None,
        refusal_ttl_s: float = REFUSAL_TTL_S,
        restart_delays_s: Sequence[float] = RESTART_DELAYS_S,
        env: dict[str, str] | None = None,
    ) -> None:
        self.command = list(command)
        self.url = url.rstrip("/")
        parts = urlsplit(self.url)
        self._address = (parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
        self.drain_timeout_s = drain_timeout_s
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.restart_delays_s = tuple(restart_delays_s)
        self.log_file = None if log_file is None else Path(log_file)
        self.record = ChildRecord(
            None if record_file is None else Path(record_file), refusal_ttl_s=refusal_ttl_s
        )
        self._on_info = on_engine_info or (lambda _platform, _backend: None)
        self._on_block_size = on_block_size or (lambda _size: None)
        self._env = env
        self._client = httpx.Client(timeout=STATE_TIMEOUT_S)
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._settled = threading.Event()  # the first start or adoption is over
        self._size = initial_block_size
        self._server: ServerProcess | None = None
        self._reader: OutputReader | None = None
        self._threads: list[threading.Thread] = []
        self._restarts: deque[float] = deque()  # when the watch restarted an exited server
        self._down: str | None = None  # why the server is down for good

    @property
    def target(self) -> str:
        return f"vllm process at {self.url}"

    @property
    def down_reason(self) -> str | None:
        """Why the server is down for good (its first start, a rollback or its restarts
        failed, or its port is taken), or None."""
        return self._down

    # ------------------------------------------------------------------ start and watch
    def start(self) -> None:
        """Adopt the server an earlier sidecar left, or start one with the initial size (in
        a thread, as the wait for /health may take minutes); then watch it."""
        with self._lock:
            if self._threads:
                return
            for target, name in ((self._first_start, "vllm-start"), (self._watch, "vllm-watch")):
                self._threads.append(threading.Thread(target=target, name=name, daemon=True))
            for thread in self._threads:
                thread.start()

    def _first_start(self) -> None:
        with self._lock:
            try:
                problem = self._adopt_or_start()
                if problem is None:
                    self._on_block_size(self._size)
                elif not self._closing.is_set():
                    self._down = problem
                    log_event(log, "vllm_start_failed", block_size=self._size, reason=problem)
            finally:
                self._settled.set()

    def _adopt_or_start(self) -> str | None:
        recorded = self.record.server
        if recorded is not None:
            orphan = ServerProcess.adopted(recorded.pid, recorded.identity)
            if orphan is not None and self._adopt(orphan, recorded) is None:
                return None
            if orphan is None:
                log_event(log, "vllm_record_stale", pid=recorded.pid, reason="not running")
            self.record.set_server(None)
        return self._start(self._size)

    def _adopt(self, orphan: ServerProcess, recorded: RecordedServer) -> str | None:
        """Serve with the server an earlier sidecar started, once it answers; else stop it."""
        self._server = orphan
        if recorded.command != self.command or recorded.port != self._address[1]:
            problem = "it was started from another command or on another port"
        else:
            problem = self._wait_healthy(orphan)
            size = self._served_block_size() if problem is None else None
            if size is not None:
                self._size, self._down = size, None
                self.record.set_server(recorded.model_copy(update={"block_size": size}))
                log_event(
                    log,
                    "vllm_adopted",
                    pid=orphan.pid,
                    block_size=size,
                    recorded_block_size=recorded.block_size,
                )
                return None
            problem = problem or "its /metrics names no block size in vllm:cache_config_info"
        log_event(log, "vllm_orphan_stopped", pid=orphan.pid, reason=problem)
        self._stop()
        return problem

    def _served_block_size(self) -> int | None:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            response = self._client.get(f"{self.url}/metrics")
            response.raise_for_status()
            sizes = parse_exposition(response.text).block_sizes
            return sizes[0] if sizes else None
        return None

    def _watch(self) -> None:
        """Notice a server that exited between switches and start it again."""
        while not self._closing.wait(WATCH_POLL_S):
            if not self._lock.acquire(blocking=False):
                continue  # a start or a switch in progress minds its own server
            try:
                server = self._server
                if server is not None and self._down is None and not server.alive():
                    self._revive(server)
            finally:
                self._lock.release()

    def _revive(self, server: ServerProcess) -> None:
        """Restart an exited server after each back-off; down when it exits too often."""
        code = _exit_code(server)
        log_event(log, "vllm_exited", pid=server.pid, exit_code=code, block_size=self._size)
        tail = [] if self._reader is None else list(self._reader.tail)
        self._stop()
        why = reason_from(f"vLLM exited with code {code}", tail)
        while not self._closing.is_set():
            now = time.monotonic()
            while self._restarts and now - self._restarts[0] >= RESTART_WINDOW_S:
                self._restarts.popleft()
            if len(self._restarts) >= len(self.restart_delays_s):
                self._down = (
                    f"{why}; restarted {len(self._restarts)} times within "
                    f"{RESTART_WINDOW_S:g} s already, so not again"
                )
                log_event(log, "vllm_down", block_size=self._size, reason=self._down)
                return
            if self._closing.wait(self.restart_delays_s[len(self._restarts)]):
                return
            self._restarts.append(time.monotonic())
            problem = self._start(self._size)
            if problem is None:
                log_event(log, "vllm_restarted", block_size=self._size, after=why)
                return
            why = problem

    # ------------------------------------------------------------------ switches
    def block_size(self) -> int | None:
        """The size the running server was started with (or found serving, when adopted),
        when it answers /health now; None until the first start or adoption is settled."""
        server = self._server
        if not self._settled.is_set() or server is None or not server.alive():
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
            refused = self._refusal(old, new_block_size)
            if refused is not None:
                return refused
            drain_note = self._drain()
            if self._closing.is_set():
                return self._outcome("failed", old, new_block_size, STOPPING, 0.0)
            began = time.monotonic()
            self._stop()
            problem = self._start(new_block_size)
            elapsed = time.monotonic() - began
            if problem is None:
                return self._outcome("done", old, new_block_size, drain_note, elapsed)
            if self._closing.is_set():
                return self._outcome("failed", old, new_block_size, STOPPING, elapsed)
            self.record.refuse(new_block_size, problem)
            log_event(log, "vllm_block_size_refused", block_size=new_block_size, reason=problem)
            back = self._start(old)
            elapsed = time.monotonic() - began
            if back is None:
                return self._outcome("rolled_back", old, new_block_size, problem, elapsed)
            self._down = f"the old size {old} did not come back either: {back}"
            reason = f"{problem}; then {self._down}"
            return self._outcome("failed", old, new_block_size, reason, elapsed)

    def _refusal(self, old: int, new: int) -> Actuation | None:
        """The outcome of a switch that is not tried (the server down, the size refused)."""
        if self._closing.is_set():
            return self._outcome("failed", old, new, STOPPING, 0.0)
        if self._down is not None:
            return self._outcome("failed", old, new, f"vLLM is down: {self._down}", 0.0)
        if self._server is None or not self._server.alive():
            code = None if self._server is None else _exit_code(self._server)
            reason = f"vLLM is not running (exit code {code}); the watch starts it again"
            return self._outcome("failed", old, new, reason, 0.0)
        refusal = self.record.refusal(new)
        if refusal is not None:
            reason = f"vLLM did not start with {new} before: {refusal.reason}"
            return self._outcome("rejected", old, new, reason, 0.0)
        return None

    def _settle_first_start(self) -> None:
        if self._threads:
            self._threads[0].join()

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
        """Wait for in-flight requests (up to the drain timeout, while the server runs); a
        note when some remained or the server exited."""
        server = self._server
        deadline = time.monotonic() + self.drain_timeout_s
        with contextlib.suppress(httpx.HTTPError):
            paused = self._client.post(
                f"{self.url}/pause", params={"mode": "wait"}, timeout=self.drain_timeout_s
            )
            if paused.status_code == 200:
                return ""
        left = None
        while server.alive():
            try:
                left = requests_in_flight(self._client.get(f"{self.url}/metrics").text)
            except (httpx.HTTPError, ValueError):
                left = None
            if left == 0:
                return ""
            if time.monotonic() >= deadline:
                counted = "an unknown number of" if left is None else str(left)
                log_event(
                    log, "vllm_drain_timeout", in_flight=left, drain_timeout_s=self.drain_timeout_s
                )
                return (
                    f"{counted} requests were still in flight after the drain timeout "
                    f"({self.drain_timeout_s:g} s); stopped anyway"
                )
            if self._closing.wait(DRAIN_POLL_S):
                return STOPPING
        code = _exit_code(server)
        log_event(log, "vllm_exited", pid=server.pid, exit_code=code, during="drain")
        return f"vLLM exited during the drain (exit code {code})"

    # ------------------------------------------------------------------ one server
    def _start(self, block_size: int) -> str | None:
        """Start the server with `block_size` and wait for /health: None, or why not."""
        if self._closing.is_set():
            return STOPPING
        taken = self._port_taken()
        if taken is not None:
            log_event(log, "vllm_port_taken", reason=taken)
            return taken
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
        server = ServerProcess.of_child(process)
        self._server = server
        self.record.set_server(
            RecordedServer(
                pid=server.pid,
                identity=server.identity,
                port=self._address[1],
                block_size=block_size,
                command=self.command,
            )
        )
        self._reader = OutputReader(process.stdout, self.log_file, self._on_info)
        problem = self._wait_healthy(server)
        if problem is not None:
            tail = list(self._reader.tail)
            self._stop()
            return reason_from(problem, tail)
        self._size, self._down = block_size, None
        log_event(
            log,
            "vllm_serving",
            block_size=block_size,
            pid=process.pid,
            start_s=round(time.monotonic() - began, 3),
        )
        return None

    def _port_taken(self) -> str | None:
        """Why the server's port is not free (something answers there), or None."""
        try:
            with socket.create_connection(self._address, timeout=PORT_CHECK_S):
                pass
        except OSError:
            return None
        port = self._address[1]
        holder = listening_pid(port)
        who = "a process this user cannot see" if holder is None else f"pid {holder}"
        return (
            f"port {port} of actuator.url {self.url} is taken by {who}, which this sidecar "
            "did not start: stop it, or give actuator.url and the command another port"
        )

    def _wait_healthy(self, server: ServerProcess) -> str | None:
        """Wait for `server` to answer /health: None, or why it did not."""
        deadline = time.monotonic() + self.start_timeout_s
        while not self._closing.is_set():
            if not server.alive():
                return f"{self.url} exited with code {_exit_code(server)} before it was ready"
            with contextlib.suppress(httpx.HTTPError):  # not listening yet: poll again
                if self._client.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return None
            if time.monotonic() >= deadline:
                return f"{self.url}/health did not answer 200 within {self.start_timeout_s:.0f} s"
            self._closing.wait(HEALTH_POLL_S)
        return STOPPING

    def _stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL it after the stop timeout."""
        server = self._server
        if server is None:
            return
        if server.stop(self.stop_timeout_s):
            log_event(log, "vllm_stop_timeout", pid=server.pid, stop_timeout_s=self.stop_timeout_s)
        self._server = None
        self.record.set_server(None)
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.join(self.stop_timeout_s)
            with contextlib.suppress(OSError, ValueError):
                reader.close()

    def close(self) -> None:
        """Stop the server (the sidecar's shutdown stops what it started), interrupting a
        start, drain or back-off in progress: bounded by about the stop timeout."""
        self._closing.set()
        server = self._server
        if server is not None:
            server.signal_group(signal.SIGTERM)  # ends a start or drain waiting on it now
        for thread in self._threads:
            thread.join()
        with self._lock:
            self._stop()
        self._client.close()


def _exit_code(server: ServerProcess) -> int | str:
    code = server.exit_code
    return "unknown (a server adopted from an earlier sidecar)" if code is None else code
