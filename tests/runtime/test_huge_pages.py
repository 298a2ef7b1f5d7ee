"""Huge pages: which mappings are collapsed, and that collapsing keeps every value."""

import errno
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from blocktune.runtime.huge_pages import (
    HUGE_PAGE_BYTES,
    _resident_anonymous_ranges,
    collapse_resident_memory,
)

SMAPS = """\
7f0000100000-7f0000b00000 rw-p 00000000 00:00 0
Size:              10240 kB
Rss:               10240 kB
7f0001000000-7f0001400000 rw-p 00000000 00:00 0
Size:               4096 kB
Rss:                  64 kB
7f0002000000-7f0002600000 r--p 00000000 08:01 1234                       /usr/lib/libfoo.so
Size:               6144 kB
Rss:                6144 kB
7f0003000000-7f0003600000 rw-s 00000000 00:01 99                         /dev/shm/x
Size:               6144 kB
Rss:                6144 kB
555500000000-555500500000 rw-p 00000000 00:00 0                          [heap]
Size:               5120 kB
Rss:                5120 kB
"""


def test_only_whole_huge_pages_of_resident_private_anonymous_memory_are_chosen():
    """The first mapping (10 MiB resident, starting 1 MiB past a 2 MiB boundary) gives its
    four whole 2 MiB pages; the next is barely resident, the library and the shared memory
    are not anonymous; the heap gives its two whole pages."""
    ranges = _resident_anonymous_ranges(SMAPS)
    assert ranges == [(0x7F0000200000, 0x7F0000A00000), (0x555500000000, 0x555500400000)]
    assert all((end - start) % HUGE_PAGE_BYTES == 0 for start, end in ranges)


def _anon_huge_bytes() -> int:
    text = Path("/proc/self/smaps_rollup").read_text()
    return int(re.search(r"AnonHugePages:\s+(\d+) kB", text).group(1)) * 1024


def _collapse_unavailable() -> str | None:
    if not sys.platform.startswith("linux"):
        return "huge pages are a Linux feature"
    enabled = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not enabled.exists() or "[never]" in enabled.read_text():
        return "transparent huge pages are off on this machine"
    release = tuple(int(part) for part in re.findall(r"\d+", os.uname().release)[:2])
    if release < (6, 1):
        return "MADV_COLLAPSE needs Linux 6.1"
    return None


@pytest.mark.skipif(_collapse_unavailable() is not None, reason=_collapse_unavailable() or "")
def test_collapsing_moves_resident_memory_into_huge_pages_and_keeps_its_values():
    values = torch.arange(8 * HUGE_PAGE_BYTES // 4, dtype=torch.float32)
    expected = values.clone()
    collapsed = collapse_resident_memory()
    if not collapsed.bytes and collapsed.reason in (
        os.strerror(errno.EAGAIN),
        os.strerror(errno.ENOMEM),
    ):
        pytest.skip(f"no free huge pages on this machine now: {collapsed.reason}")
    assert collapsed.bytes >= 4 * HUGE_PAGE_BYTES, collapsed
    # At least the tensor's whole 2 MiB ranges are huge pages now (some may have been
    # before, where the system's transparent huge pages are "always").
    assert _anon_huge_bytes() >= 4 * HUGE_PAGE_BYTES
    assert torch.equal(values, expected)
