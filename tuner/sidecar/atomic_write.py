"""Writing a file so that a crash leaves the old one or the new one, never half of either."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["write_atomically"]


def write_atomically(path: Path, data: bytes, *, suffix: str) -> None:
    """Write `data` to a temporary `.NAME.*SUFFIX` beside `path`, fsync it and rename it over
    `path`; the temporary is removed when anything fails (and the error raised)."""
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
