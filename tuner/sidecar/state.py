"""The sidecar's state file: the window and the last decision, saved atomically.

`StateFile.save` writes JSON to a temporary file in the same folder, flushes
it to disk and renames it over the state file (`os.replace`), so a crash
leaves either the old state or the new one, never half of one; a state
larger than a load would read is refused (`StateTooLarge`) and the last good
file stays. The temporaries a crash leaves behind are removed at the next
load. `load` reads it back and checks it against the policy: a file that is not standard JSON,
not a valid state, larger than a window of the policy's capacity can be, or
that does not fit the policy (another deployment, a block size that is not
one of its candidates, more rows than the window holds, a restart longer than
any duration a policy accepts, a switch or a save later than now by more than
`MAX_CLOCK_SKEW_S`) is reported (a log
line naming the file and the problem) and set aside as
`FILE.corrupt-<UTC timestamp>`, and the sidecar starts fresh. A state file
that cannot be read at all (a folder, a FIFO or another file that is not a
regular one, a path through a file), or a corrupt one
that cannot be set aside (a read-only folder), raises `StateFileError`: the
sidecar does not start until an operator looks.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    model_validator,
)

from blocktune.traces.schema import MAX_TOKENS
from blocktune.tuner.config.config_files import format_location
from blocktune.tuner.config.jsonable import from_json
from blocktune.tuner.config.policy import MAX_DURATION, BlockSize, Policy
from blocktune.tuner.operations import log_event
from blocktune.tuner.sidecar.atomic_write import write_atomically

__all__ = [
    "MAX_CLOCK_SKEW_S",
    "STATE_VERSION",
    "SavedState",
    "SavedWindow",
    "StateFile",
    "StateFileError",
    "StateTooLarge",
]

STATE_VERSION = 1
BYTES_PER_ROW = 128  # a window row as JSON is at most about 70 bytes
BYTES_BESIDE_ROWS = 1 << 20  # the last decision and the envelope
RESTARTS_SAVED = 100
"""The most measured restarts a state file may hold (the sidecar keeps fewer)."""
MAX_CLOCK_SKEW_S = 60.0
"""How far a saved time may be ahead of this clock (another host's, a corrected clock);
later is a state the sidecar cannot use: a switch in the future would freeze switching."""
log = logging.getLogger("blocktune.sidecar")
TEMPORARY_SUFFIX = ".tmp"
"""The ending of a save's temporary file (one a crash left behind is removed at load)."""

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


class StateFileError(ValueError):
    """A state file that can neither be read nor set aside; the message names it and why."""


class StateTooLarge(ValueError):
    """A state that would take more bytes than a load reads; it was not saved."""


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SavedWindow(_Frozen):
    """The length window's rows, oldest first (prefix groups as their 63-bit keys), and the
    requests observed over the sidecar's lifetime (absent in files of older versions)."""

    timestamps: list[FiniteFloat]
    prompt_tokens: list[Annotated[int, Field(ge=1, le=MAX_TOKENS)]]
    output_tokens: list[Annotated[int, Field(ge=0, le=MAX_TOKENS)]]
    prefix_keys: list[Annotated[int, Field(ge=0, lt=2**63)]]
    has_prefix: list[bool]
    observed_total: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _same_lengths(self) -> SavedWindow:
        columns = ("timestamps", "prompt_tokens", "output_tokens", "prefix_keys", "has_prefix")
        lengths = {len(getattr(self, name)) for name in columns}
        if len(lengths) != 1:
            raise ValueError(f"the window's columns differ in length: {sorted(lengths)}")
        if self.observed_total is not None and self.observed_total < len(self.timestamps):
            raise ValueError(
                f"observed_total {self.observed_total} is less than the window's "
                f"{len(self.timestamps)} rows"
            )
        return self

    @property
    def lifetime_total(self) -> int:
        """Requests observed over the sidecar's lifetime (the rows, for older files)."""
        return len(self.timestamps) if self.observed_total is None else self.observed_total


class SavedState(_Frozen):
    """Everything the sidecar restores at start.

    Validated with ``context={"policy": policy}``, the state must also fit that
    policy: the same deployment, block sizes among its candidates, and no more rows
    than its window holds; and this clock: no save or switch in the future.
    """

    version: Literal[1] = STATE_VERSION
    saved_at: FiniteFloat
    deployment: str
    current_block_size: BlockSize
    last_switch_at: FiniteFloat | None = None
    recommended_block_size: BlockSize | None = None
    window: SavedWindow
    recommendation: dict | None = None
    actuation: dict | None = None
    restarts_s: list[
        Annotated[float, Field(ge=0, le=MAX_DURATION.total_seconds(), allow_inf_nan=False)]
    ] = Field(default=[], max_length=RESTARTS_SAVED)
    """The last measured engine restarts (stop to healthy) [s], oldest first."""

    @model_validator(mode="after")
    def _fits_the_policy(self, info: ValidationInfo) -> SavedState:
        policy: Policy | None = (info.context or {}).get("policy")
        if policy is None:
            return self
        if self.deployment != policy.deployment:
            raise ValueError(
                f"the state is deployment {self.deployment!r}'s, not {policy.deployment!r}'s"
            )
        for name in ("current_block_size", "recommended_block_size"):
            size = getattr(self, name)
            if size is not None and size not in policy.candidates:
                raise ValueError(
                    f"the state's {name} {size} is not one of the policy's candidates "
                    f"{list(policy.candidates)}"
                )
        rows, capacity = len(self.window.timestamps), policy.window.capacity
        if rows > capacity:
            raise ValueError(f"the window holds {rows} rows, more than its capacity {capacity}")
        latest = time.time() + MAX_CLOCK_SKEW_S
        for name in ("saved_at", "last_switch_at"):
            at = getattr(self, name)
            if at is not None and at > latest:
                raise ValueError(
                    f"the state's {name} {at:.0f} is {at - time.time():.0f} s in the future "
                    f"(more than the {MAX_CLOCK_SKEW_S:g} s a clock may be off)"
                )
        return self


class StateFile:
    """Atomic saves and tolerant loads of one state file."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.set_aside_as: Path | None = None  # where the last corrupt file went
        self._lock = threading.Lock()

    @staticmethod
    def byte_limit(policy: Policy) -> int:
        """The most bytes a state file of `policy` may take: what its window's rows and the
        last decision need."""
        return BYTES_BESIDE_ROWS + BYTES_PER_ROW * policy.window.capacity

    def save(self, state: SavedState, policy: Policy) -> None:
        """Write `state` atomically (temporary file in the same folder, fsync, rename).

        Raises `StateTooLarge`, writing nothing, when it would take more bytes than `load`
        reads for `policy` (the last good file stays).
        """
        data = state.model_dump_json().encode("utf-8")
        limit = self.byte_limit(policy)
        if len(data) > limit:
            raise StateTooLarge(
                f"{self.path}: the state takes {len(data)} bytes, over the {limit} a state "
                f"file of a {policy.window.capacity}-row window may take; not saved"
            )
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(self.path, data, suffix=TEMPORARY_SUFFIX)

    @property
    def _temporary_prefix(self) -> str:
        return f".{self.path.name}."

    def load(self, policy: Policy) -> SavedState | None:
        """The saved state if it fits `policy`; None when there is none or it was set aside.

        Raises `StateFileError` when the file cannot be read or set aside.
        """
        capacity = policy.window.capacity
        limit = self.byte_limit(policy)
        with self._lock:
            self._remove_temporaries()
            try:
                data = self._read(limit + 1)
            except FileNotFoundError:
                return None
            except OSError as error:
                raise StateFileError(
                    f"{self.path}: cannot read the state file: {error.strerror}"
                ) from None
            if len(data) > limit:
                problem = f"over {limit} bytes, more than a window of {capacity} rows needs"
            else:
                try:
                    return SavedState.model_validate(from_json(data), context={"policy": policy})
                except ValueError as error:
                    problem = _describe(error)
            self._set_aside(problem)
            return None

    def _read(self, most: int) -> bytes:
        """Up to `most` bytes of the file; `OSError` unless it is a regular file (opened
        without blocking, so a FIFO cannot hang the start)."""
        descriptor = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(descriptor, "rb") as handle:
            mode = os.fstat(descriptor).st_mode
            if stat.S_ISDIR(mode):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
            if not stat.S_ISREG(mode):
                raise OSError(errno.EINVAL, "not a regular file (a FIFO, socket or device)")
            return handle.read(most)

    def _remove_temporaries(self) -> None:
        """Remove the temporaries of saves that a crash interrupted (one sidecar per file)."""
        for temporary in self.path.parent.glob(f"{self._temporary_prefix}*{TEMPORARY_SUFFIX}"):
            with contextlib.suppress(OSError):  # a folder we cannot write: the saves fail too
                temporary.unlink()

    def _set_aside(self, problem: str) -> None:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
        aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        try:
            os.replace(self.path, aside)
        except OSError as error:
            raise StateFileError(
                f"{self.path}: the state file is unusable ({problem}) and cannot be set aside "
                f"({error.strerror}): move it away, or let the sidecar write to its folder"
            ) from None
        self.set_aside_as = aside
        log_event(
            log,
            "state_file_corrupt",
            file=str(self.path),
            problem=problem,
            moved_to=str(aside),
        )


def _describe(error: ValueError) -> str:
    if isinstance(error, ValidationError):
        first = error.errors()[0]
        return (
            f"{error.error_count()} problem(s); first: {format_location(first['loc'])}: "
            f"{first['msg']}"
        )
    return f"not valid JSON: {error}"
