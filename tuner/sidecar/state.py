"""The sidecar's state file: the window and the last decision, saved atomically.

`StateFile.save` writes JSON to a temporary file in the same folder, flushes
it to disk and renames it over the state file (`os.replace`), so a crash
leaves either the old state or the new one, never half of one. `load` reads it
back; a file that is not valid JSON or not a valid state is reported (a log
line naming the file and the problem) and set aside as
`FILE.corrupt-<UTC timestamp>`, and the sidecar starts fresh.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from blocktune.kernels import is_power_of_two
from blocktune.tuner.core.config_files import format_location
from blocktune.tuner.operations import log_event

__all__ = ["STATE_VERSION", "SavedState", "SavedWindow", "StateFile"]

STATE_VERSION = 1
log = logging.getLogger("blocktune.sidecar")


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SavedWindow(_Frozen):
    """The length window's rows, oldest first (prefix groups as their 63-bit keys)."""

    timestamps: list[float]
    prompt_tokens: list[Annotated[int, Field(ge=1)]]
    output_tokens: list[Annotated[int, Field(ge=0)]]
    prefix_keys: list[Annotated[int, Field(ge=0, lt=2**63)]]
    has_prefix: list[bool]

    @model_validator(mode="after")
    def _same_lengths(self) -> SavedWindow:
        lengths = {len(getattr(self, name)) for name in type(self).model_fields}
        if len(lengths) != 1:
            raise ValueError(f"the window's columns differ in length: {sorted(lengths)}")
        return self


class SavedState(_Frozen):
    """Everything the sidecar restores at start."""

    version: Literal[1] = STATE_VERSION
    saved_at: float
    deployment: str
    current_block_size: int = Field(gt=0)
    last_switch_at: float | None = None
    recommended_block_size: int | None = None
    window: SavedWindow
    recommendation: dict | None = None
    actuation: dict | None = None

    @model_validator(mode="after")
    def _power_of_two(self) -> SavedState:
        size = self.current_block_size
        if not is_power_of_two(size):
            raise ValueError(f"current_block_size {size} is not a power of two")
        return self


class StateFile:
    """Atomic saves and tolerant loads of one state file."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.set_aside_as: Path | None = None  # where the last corrupt file went
        self._lock = threading.Lock()

    def save(self, state: SavedState) -> None:
        """Write `state` atomically (temporary file in the same folder, fsync, rename)."""
        data = state.model_dump_json().encode("utf-8")
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(
                prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent
            )
            try:
                with os.fdopen(handle, "wb") as out:
                    out.write(data)
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(temporary, self.path)
            except BaseException:
                Path(temporary).unlink(missing_ok=True)
                raise

    def load(self) -> SavedState | None:
        """The saved state; None when there is none or it was corrupt (then set aside)."""
        with self._lock:
            try:
                data = self.path.read_bytes()
            except FileNotFoundError:
                return None
            try:
                return SavedState.model_validate(json.loads(data))
            except (UnicodeDecodeError, ValueError) as error:
                self._set_aside(_describe(error))
                return None

    def _set_aside(self, problem: str) -> None:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
        aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        os.replace(self.path, aside)
        self.set_aside_as = aside
        log_event(
            log,
            "state_file_corrupt",
            file=str(self.path),
            problem=problem,
            moved_to=str(aside),
        )


def _describe(error: Exception) -> str:
    if isinstance(error, ValidationError):
        first = error.errors()[0]
        return (
            f"{error.error_count()} problem(s); first: {format_location(first['loc'])}: "
            f"{first['msg']}"
        )
    return f"not valid JSON: {error}"
