"""A server process the sidecar supervises: a child it started, or one an earlier sidecar
started and it adopted.

A process is known by its pid and its start identity (the boot it runs in and its
start time, field 22 of `/proc/<pid>/stat`), so a pid the kernel has given to
another process since is never taken for it. The server leads its own process
group, and the group gets the signals: vLLM's engine processes go with it. Where
`/proc` is missing (not Linux), no process has an identity, so none is adopted.

`listening_pid` names the process that listens on a TCP port (from
`/proc/net/tcp*` and the sockets in `/proc/<pid>/fd`, as far as this user may read
them), for the error when something the sidecar did not start holds its port.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

__all__ = ["ServerProcess", "listening_pid", "start_identity"]

PROC = Path("/proc")
BOOT_ID = PROC / "sys" / "kernel" / "random" / "boot_id"
GONE_POLL_S = 0.05
KILL_WAIT_S = 5.0
"""How long a process killed with SIGKILL may take to be gone."""
LISTEN = "0A"  # the TCP state LISTEN in /proc/net/tcp


def start_identity(pid: int) -> str | None:
    """The boot and start time of the living process `pid` (None when there is none, it
    is a zombie, or `/proc` is not there)."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
        boot = BOOT_ID.read_text().strip()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after the command's name, which may hold spaces
    if fields[0] in ("Z", "X"):  # exited, not yet (or never to be) reaped
        return None
    return f"{boot}/{fields[19]}"


def listening_pid(port: int) -> int | None:
    """The pid of a process this user may see that listens on TCP `port`, or None."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for row in (PROC / "net" / table).read_text().splitlines()[1:]:
                fields = row.split()
                if fields[3] == LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if any(os.readlink(fd) in inodes for fd in (entry / "fd").iterdir()):
                return int(entry.name)
    return None


class ServerProcess:
    """One supervised server: its pid, its start identity and, for a child of this
    process, the `Popen` that reaps it and knows its exit code."""

    def __init__(
        self, pid: int, identity: str | None, popen: subprocess.Popen | None = None
    ) -> None:
        self.pid = pid
        self.identity = identity
        self._popen = popen

    @classmethod
    def of_child(cls, popen: subprocess.Popen) -> ServerProcess:
        """A child just started (in its own process group)."""
        return cls(popen.pid, start_identity(popen.pid), popen)

    @classmethod
    def adopted(cls, pid: int, identity: str | None) -> ServerProcess | None:
        """The process `pid` if it still runs with `identity`, else None."""
        if identity is None or start_identity(pid) != identity:
            return None
        return cls(pid, identity)

    @property
    def is_child(self) -> bool:
        return self._popen is not None

    def alive(self) -> bool:
        """Whether the server still runs (a child's exit is reaped here)."""
        if self._popen is not None:
            return self._popen.poll() is None
        return self.identity is not None and start_identity(self.pid) == self.identity

    @property
    def exit_code(self) -> int | None:
        """A child's exit code once it exited (negative: the signal); None for an adopted
        process (its parent reaps it) or one still running."""
        return None if self._popen is None else self._popen.returncode

    def signal_group(self, signum: int) -> None:
        """Send `signum` to the server's process group (nothing when it is gone)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signum)

    def wait_gone(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the server to exit: whether it did."""
        if self._popen is not None:
            try:
                self._popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                return False
            return True
        deadline = time.monotonic() + timeout_s
        while self.alive():
            if time.monotonic() >= deadline:
                return False
            time.sleep(GONE_POLL_S)
        return True

    def stop(self, timeout_s: float) -> bool:
        """SIGTERM the group, SIGKILL it after `timeout_s`; whether SIGKILL was needed."""
        killed = False
        running = self.alive()
        if running:
            self.signal_group(signal.SIGTERM)
            if not self.wait_gone(timeout_s):
                killed = True
                self.signal_group(signal.SIGKILL)
                self.wait_gone(KILL_WAIT_S)
        if running or self.is_child:  # never a group whose leader's pid may be another's now
            self.signal_group(signal.SIGKILL)  # whatever the group left behind
        return killed
