"""Request lengths from a JSONL request log that a server appends to.

Each line is one finished request, a JSON object whose fields (configurable,
dotted paths for nested objects) give the prompt and output lengths and,
optionally, the finish time and prefix group. The follower keeps the file open
and reads what was appended since the last poll (at most `max_bytes` per poll;
the rest waits for the next one). It survives

- rotation (the path now names another file, by device and inode, e.g.
  logrotate's rename): the old file is read to its end, then the new one from
  its start;
- truncation and rewrites in place (copytruncate, `> file`, a file written
  over): the file is shorter than what was read, or its fingerprint differs
  from the one taken at the last read (its first `FINGERPRINT_BYTES`, and the
  `FINGERPRINT_BYTES` before the offset read to), as when it was truncated
  and written past the old offset between two polls, keeping its first lines
  or not: it is read again from its start;
- a missing file: the poll fails (and is counted) until the file appears.

A line that is not standard JSON (see `from_json`: NaN, lone surrogates and
deep nesting are refused), not an object, or whose fields are missing or
invalid is skipped and counted as a source error, and the other lines of the
poll are observed; a partial last line waits for its newline. A line over
`MAX_LINE_BYTES` is skipped unread and counted (`oversized_lines` in the
source's status, and a source error): the follower drops its bytes as they come
and reads on from the next newline, so it never holds more of a line than that.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError

from blocktune.tuner.config.jsonable import from_json
from blocktune.tuner.config.policy import JsonlLogSettings
from blocktune.tuner.sidecar.sources import Observation, Observations, PollingSource, Sink

__all__ = ["MAX_LINE_BYTES", "JsonlLogFollower"]

MAX_BYTES_PER_POLL = 8 << 20
MAX_LINE_BYTES = 1 << 20
"""The longest line the follower holds and reads; a longer one is skipped and counted."""
FINGERPRINT_BYTES = 256


class _BadLine(ValueError):
    """A log line that is not a usable finished-request record."""


_ABSENT = object()


def _lookup(record: dict, path: str) -> object:
    """The value at a dotted path, or `_ABSENT`."""
    value: object = record
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return _ABSENT
        value = value[part]
    return value


class JsonlLogFollower(PollingSource):
    """Follows one JSONL request log through appends, rotation and truncation."""

    name = "jsonl_log"

    def __init__(
        self,
        settings: JsonlLogSettings,
        sink: Sink,
        *,
        base: Path = Path("."),
        clock: Callable[[], float] = time.time,
        max_bytes: int = MAX_BYTES_PER_POLL,
    ) -> None:
        self.settings = settings
        self.interval_s = settings.interval.total_seconds()
        super().__init__()
        path = Path(settings.path).expanduser()
        self.path = path if path.is_absolute() else base / path
        self._sink = sink
        self._clock = clock
        self._max_bytes = max_bytes
        self._file = None
        self._partial = b""
        self._skipping = False  # inside a line over MAX_LINE_BYTES: dropped to its newline
        self._fingerprint = b""  # the file's first and last bytes as read (_fingerprint_now)
        self.bad_lines = 0
        self.rotations = 0
        self.truncations = 0
        if settings.start_at == "end" and self.path.is_file():
            self._open(at_end=True)

    def _open(self, *, at_end: bool = False) -> None:
        self._file = open(self.path, "rb")  # noqa: SIM115 - held open across polls
        if at_end:
            self._file.seek(0, os.SEEK_END)
        self._partial, self._skipping = b"", False
        self._fingerprint = self._fingerprint_now()

    def _fingerprint_now(self) -> bytes:
        """The file's first `FINGERPRINT_BYTES` and the `FINGERPRINT_BYTES` before the offset
        read to (fewer in a shorter file), as they are on disk now."""
        offset, descriptor = self._file.tell(), self._file.fileno()
        size = min(FINGERPRINT_BYTES, offset)
        return os.pread(descriptor, size, 0) + os.pread(descriptor, size, offset - size)

    def _rewritten(self, size: int) -> bool:
        """Shorter than what was read, or other bytes than those read where they were."""
        return size < self._file.tell() or self._fingerprint_now() != self._fingerprint

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def poll(self) -> int:
        lines: list[bytes] = []
        if self._file is None:
            if not self.path.is_file():
                raise FileNotFoundError(f"{self.path}: no such request log (yet)")
            self._open()
        current = os.fstat(self._file.fileno())
        try:
            named = os.stat(self.path)
        except FileNotFoundError:
            named = None
        same_file = named is not None and os.path.samestat(named, current)
        if same_file and self._rewritten(named.st_size):
            self.truncations += 1
            self._file.seek(0)
            self._partial = self._fingerprint = b""
            self._skipping = False
        drained = self._read(lines)
        if not same_file and drained:
            if self._partial:
                lines.append(self._partial)
            self.close()
            if named is not None:
                self.rotations += 1
                self._open()
                self._read(lines)
        return self._deliver(lines)

    def _read(self, lines: list[bytes]) -> bool:
        """Append the complete new lines to `lines` (those over `MAX_LINE_BYTES` skipped and
        counted); True when the file was read to its end."""
        chunk = self._file.read(self._max_bytes)
        self._fingerprint = self._fingerprint_now()
        pieces = chunk.split(b"\n")
        pieces[0] = b"" if self._skipping else self._partial + pieces[0]
        self._skipping = self._skipping and len(pieces) == 1
        *complete, self._partial = pieces
        for line in complete:
            if len(line) > MAX_LINE_BYTES:
                self._skip_oversized()
            else:
                lines.append(line)
        if len(self._partial) > MAX_LINE_BYTES:
            self._partial, self._skipping = b"", True
            self._skip_oversized()
        return len(chunk) < self._max_bytes

    def _skip_oversized(self) -> None:
        self.status.oversized(
            f"{self.path}: a line over {MAX_LINE_BYTES} bytes was skipped "
            f"({self.status.oversized_lines + 1} so far)"
        )

    def _deliver(self, lines: list[bytes]) -> int:
        now = self._clock()
        items, bad, last_error = [], 0, None
        for line in lines:
            if not line.strip():
                continue
            try:
                items.append(self._parse(line))
            except _BadLine as error:
                bad += 1
                last_error = str(error)
        if bad:
            self.bad_lines += bad
            self.status.bad_items(bad, last_error)
        if items:
            self._sink(Observations.of(items, now=now))
        return len(items)

    def _parse(self, line: bytes) -> Observation:
        try:
            record = from_json(line)
        except ValueError as error:
            raise _BadLine(f"{self.path}: a line is not JSON: {error}") from None
        if not isinstance(record, dict):
            raise _BadLine(f"{self.path}: a line is not a JSON object")
        s = self.settings
        names = {
            "prompt_tokens": s.prompt_field,
            "output_tokens": s.output_field,
            "timestamp": s.timestamp_field,
            "prefix_group": s.prefix_field,
        }
        fields = {}
        for key, path in names.items():
            value = _ABSENT if path is None else _lookup(record, path)
            if value is not _ABSENT:
                fields[key] = value
        if fields.get("prefix_group") is not None:
            fields["prefix_group"] = str(fields["prefix_group"])
        try:
            return Observation.model_validate(fields)
        except ValidationError as error:
            first = error.errors()[0]
            field = names.get(str(first["loc"][0]), str(first["loc"][0]))
            raise _BadLine(f"{self.path}: field {field!r}: {first['msg']}") from None
