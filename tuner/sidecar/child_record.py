"""What the vLLM actuator keeps on disk beside the sidecar's state file: the server it runs
and the block sizes vLLM refused (`<state file>.vllm.json`).

The server is recorded the moment it is started (pid, start identity, port, block
size, the command it was started from) and cleared once it is stopped, so a sidecar
started after a crash (`kill -9`) finds the server the last one left running, even
one killed in the middle of a restart. A refused size is kept with its reason and
the time, and forgotten `refusal_ttl` later (vLLM or its environment may have
changed since). Each change is written atomically (a temporary file in the same
folder, fsync, rename); a file that cannot be read or holds no valid record is
logged and left to be overwritten: the port is checked at every start anyway, so
nothing is served twice for want of the record. Without a state file the record
lives in memory only.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from blocktune.tuner.config.policy import MAX_BLOCK_SIZE
from blocktune.tuner.operations import log_event
from blocktune.tuner.sidecar.atomic_write import write_atomically

__all__ = ["ChildRecord", "RecordedServer", "Refusal", "record_path"]

log = logging.getLogger("blocktune.sidecar")

RECORD_SUFFIX = ".vllm.json"
MAX_RECORD_BYTES = 1 << 20
TEMPORARY_SUFFIX = ".part"  # not the state file's ".tmp", which its load removes
MAX_REASON_CHARS = 1000
Size = Annotated[int, Field(gt=0, le=MAX_BLOCK_SIZE)]


class RecordedServer(BaseModel):
    """A server the actuator started: enough to know it again and to stop it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pid: int = Field(gt=0)
    identity: str | None = Field(max_length=200)
    port: int = Field(ge=1, le=65535)
    block_size: Size
    command: list[str]


class Refusal(BaseModel):
    """Why vLLM did not start with a size, and when (seconds since the epoch)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    reason: str = Field(max_length=MAX_REASON_CHARS)
    at: float = Field(allow_inf_nan=False)


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")

    server: RecordedServer | None = None
    refused: dict[Size, Refusal] = Field(default_factory=dict)


def record_path(state_file: Path | str) -> Path:
    """Where the actuator's record of a sidecar with `state_file` lives."""
    state = Path(state_file)
    return state.with_name(state.name + RECORD_SUFFIX)


class ChildRecord:
    """The actuator's record, loaded from `path` (None: kept in memory only) and saved
    there after each change; refusals older than `refusal_ttl_s` are forgotten."""

    def __init__(self, path: Path | None, *, refusal_ttl_s: float) -> None:
        self.path = path
        self.refusal_ttl_s = refusal_ttl_s
        self._lock = threading.Lock()
        self._record = self._load()

    @property
    def server(self) -> RecordedServer | None:
        return self._record.server

    def set_server(self, server: RecordedServer | None) -> None:
        """Record the server now running (None: none is)."""
        with self._lock:
            self._record.server = server
            self._save()

    def refusal(self, block_size: int) -> Refusal | None:
        """Why `block_size` was refused, while that is recent enough to hold."""
        refusal = self._record.refused.get(block_size)
        if refusal is None or not 0 <= time.time() - refusal.at < self.refusal_ttl_s:
            return None
        return refusal

    def refuse(self, block_size: int, reason: str) -> None:
        with self._lock:
            now = time.time()
            self._record.refused = {
                size: kept
                for size, kept in self._record.refused.items()
                if 0 <= now - kept.at < self.refusal_ttl_s
            }
            self._record.refused[block_size] = Refusal(reason=reason[:MAX_REASON_CHARS], at=now)
            self._save()

    def _load(self) -> _Record:
        if self.path is None:
            return _Record()
        for temporary in self.path.parent.glob(f".{self.path.name}*{TEMPORARY_SUFFIX}"):
            with contextlib.suppress(OSError):  # a save a crash interrupted
                temporary.unlink()
        try:
            with self.path.open("rb") as handle:
                data = handle.read(MAX_RECORD_BYTES + 1)
            if len(data) > MAX_RECORD_BYTES:
                raise ValueError(f"over {MAX_RECORD_BYTES} bytes")
            return _Record.model_validate_json(data)
        except FileNotFoundError:
            return _Record()
        except (OSError, ValueError, ValidationError) as error:
            log_event(log, "vllm_record_unreadable", file=str(self.path), error=str(error)[:300])
            return _Record()

    def _save(self) -> None:
        """Write the record atomically; a failure is logged, never raised."""
        if self.path is None:
            return
        data = self._record.model_dump_json().encode("utf-8")
        try:
            write_atomically(self.path, data, suffix=TEMPORARY_SUFFIX)
        except OSError as error:
            log_event(log, "vllm_record_save_failed", file=str(self.path), error=str(error))
