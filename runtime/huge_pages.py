"""The process's resident memory in 2 MiB pages (Linux), once the weights and the KV pool are in.

A decode step streams every weight and the batch's KV blocks through the CPU. In 4 KiB pages
that is a page-table walk every 4 KiB the TLB does not hold, and a model's weights are far
more pages than it holds; in 2 MiB pages, 512 times fewer. Where transparent huge pages are
"madvise" (the default of many distributions) memory nobody advised stays in 4 KiB pages,
and torch, oneDNN (the packed weights) and glibc advise none of theirs.
`collapse_resident_memory` advises every private anonymous mapping with at least 2 MiB
resident (`MADV_HUGEPAGE`) and collapses its whole 2 MiB ranges into huge pages at once
(`MADV_COLLAPSE`, Linux 6.1 and later): same memory, same contents, fewer pages. Memory
that is not resident is left alone, so nothing is committed that was not already.
"""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["HUGE_PAGE_BYTES", "Collapsed", "collapse_resident_memory"]

HUGE_PAGE_BYTES = 2 << 20
"""The size of a transparent huge page on x86-64 and (with 4 KiB base pages) arm64."""

MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25


@dataclass(frozen=True)
class Collapsed:
    """What `collapse_resident_memory` did: the bytes collapsed into huge pages, those of the
    ranges the kernel refused (wholly or in part) and why, or why it could not try."""

    bytes: int
    refused_bytes: int = 0
    reason: str = ""


def _resident_anonymous_ranges(smaps: str) -> list[tuple[int, int]]:
    """The whole 2 MiB ranges of the private anonymous writable mappings in `smaps` (the text
    of /proc/self/smaps) with at least 2 MiB resident."""
    ranges, current = [], None
    for line in smaps.splitlines():
        fields = line.split()
        if not fields:
            continue
        if "-" in fields[0] and not fields[0].endswith(":"):
            start, end = (int(value, 16) for value in fields[0].split("-"))
            path = fields[5] if len(fields) > 5 else ""
            anonymous = fields[1].startswith("rw") and fields[1].endswith("p")
            current = (start, end) if anonymous and path in ("", "[heap]") else None
        elif fields[0] == "Rss:" and current is not None:
            if int(fields[1]) * 1024 >= HUGE_PAGE_BYTES:
                start = -(-current[0] // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
                end = current[1] // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
                if end > start:
                    ranges.append((start, end))
            current = None
    return ranges


def collapse_resident_memory() -> Collapsed:
    """Back this process's resident anonymous memory with huge pages (see the module
    docstring); call it once the weights are packed and the KV pool allocated."""
    smaps = Path("/proc/self/smaps")
    if not sys.platform.startswith("linux") or not smaps.exists():
        return Collapsed(0, reason="huge pages are collapsed on Linux only")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    done = refused = 0
    errors = set()
    for start, end in _resident_anonymous_ranges(smaps.read_text()):
        libc.madvise(start, end - start, MADV_HUGEPAGE)
        if libc.madvise(start, end - start, MADV_COLLAPSE) == 0:
            done += end - start
        else:
            refused += end - start
            errors.add(ctypes.get_errno())
    reason = ", ".join(sorted(os.strerror(error) for error in errors))
    return Collapsed(done, refused, reason)
