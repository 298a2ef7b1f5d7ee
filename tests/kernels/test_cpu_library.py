"""The cached C library of the CPU kernels: a cached file that does not load (empty, cut
short by a crash) is rebuilt once; where the rebuild fails too, the torch backend serves
and the reason is logged."""

import ctypes
import os

import pytest

from blocktune.kernels import cpu_attention, cpu_library

pytestmark = pytest.mark.skipif(cpu_library._compiler() is None, reason="no C compiler")


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """An empty kernel cache, and `cpu_library` loaded afresh (and again after the test)."""
    monkeypatch.setenv("BLOCKTUNE_CACHE", str(tmp_path / "cache"))
    cpu_library.cpu_library.cache_clear()
    yield tmp_path / "cache"
    monkeypatch.undo()
    cpu_library.cpu_library.cache_clear()


def cached_library(contents: bytes):
    """The cache's library for the current compiler, holding `contents`."""
    target = cpu_library.library_path(cpu_library._compiler())
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(contents)
    return target


@pytest.mark.parametrize(
    "contents", [b"", b"\x7fELF\x02\x01\x01" + bytes(57)], ids=["empty", "cut"]
)
def test_a_cached_library_that_does_not_load_is_rebuilt(cache, contents, caplog):
    target = cached_library(contents)
    with pytest.raises(OSError):
        ctypes.CDLL(str(target))  # what stopped every worker start
    with caplog.at_level("WARNING", logger="blocktune.kernels"):
        library = cpu_library.cpu_library()
    assert not isinstance(library, str), library
    assert target.stat().st_size > 4096
    assert cpu_attention.default_backend("cpu") == "cpu"
    assert any("does not load" in record.getMessage() for record in caplog.records)


def test_a_failed_rebuild_falls_back_to_torch_with_the_reason(cache, monkeypatch, caplog):
    monkeypatch.setenv("CC", "cc --no-such-flag")
    target = cached_library(b"")
    with caplog.at_level("WARNING", logger="blocktune.kernels"):
        reason = cpu_library.cpu_kernel_error()
    assert reason is not None
    assert f"the cached {target} does not load" in reason
    assert "rebuilding it failed" in reason and "--no-such-flag" in reason
    assert cpu_attention.default_backend("cpu") == "torch"
    logged = [record.getMessage() for record in caplog.records]
    assert any("torch" in message and reason in message for message in logged), logged


def test_the_library_is_on_disk_before_it_is_renamed_into_the_cache(cache, monkeypatch):
    events = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append("fsync") or fsync(fd))
    monkeypatch.setattr(os, "replace", lambda *a: events.append("replace") or replace(*a))
    failure = cpu_library.build(cpu_library._compiler(), cache / "cpu_kernels-test.so")
    assert failure is None
    assert events == ["fsync", "replace"]
