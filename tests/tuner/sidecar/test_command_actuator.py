"""The `command` actuator's process group: a script judged by its exit status (not by who
still holds its output), and a timed-out script stopped with everything it started."""

import os
import signal
import stat
import threading
import time
from pathlib import Path

import pytest

from blocktune.tuner.sidecar import command_actuator
from blocktune.tuner.sidecar.command_actuator import CommandActuator


def script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "restart-vllm.sh"
    path.write_text(f"#!/bin/sh\n{body}\n", encoding="utf-8")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie no orphan reaper has reaped yet is not)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return fields[0] != "Z"


def group_members(pgid: int) -> list[int]:
    """The live processes whose process group is `pgid`."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def group_gone(pgid: int) -> bool:
    """Whether the group has no live process within 2 s (SIGKILL is delivered asynchronously)."""
    deadline = time.monotonic() + 2
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return group_members(pgid) == []


def read_pids(path: Path) -> list[int]:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().split()) >= 2:
            return [int(pid) for pid in path.read_text().split()]
        time.sleep(0.02)
    raise AssertionError(f"{path} never held the script's pids")


def test_a_script_that_exits_0_leaving_a_background_child_is_done_at_once(tmp_path):
    pids = tmp_path / "pids"
    body = f'sleep 30 &\necho "$$ $!" > {pids}\necho started "$1"'
    actuator = CommandActuator([str(script(tmp_path, body)), "{block_size}"], timeout_s=5)
    began = time.monotonic()
    outcome = actuator.apply(64, 32)
    elapsed = time.monotonic() - began
    shell, background = read_pids(pids)
    try:
        assert outcome.status == "done", outcome.reason
        assert elapsed < 3
        assert os.getpgid(background) == shell != os.getpgid(0)
    finally:
        os.kill(background, signal.SIGKILL)


def test_a_timed_out_script_leaves_no_process_of_its_group(tmp_path):
    pids = tmp_path / "pids"
    body = f'sleep 30 &\necho "$$ $!" > {pids}\nsleep 30'
    actuator = CommandActuator([str(script(tmp_path, body)), "{block_size}"], timeout_s=0.5)
    outcome = actuator.apply(64, 32)
    shell, background = read_pids(pids)
    assert outcome.status == "failed" and "did not finish within 0.5 s" in outcome.reason
    assert shell != os.getpgid(0)
    assert group_gone(shell)
    assert not running(shell) and not running(background)


def test_a_script_ignoring_sigterm_is_killed_after_the_grace(tmp_path, monkeypatch):
    monkeypatch.setattr(command_actuator, "KILL_GRACE_S", 0.3)
    pids = tmp_path / "pids"
    body = f"trap '' TERM\nsleep 30 &\necho \"$$ $!\" > {pids}\nwhile :; do sleep 0.1; done"
    actuator = CommandActuator([str(script(tmp_path, body)), "{block_size}"], timeout_s=0.5)
    began = time.monotonic()
    outcome = actuator.apply(64, 32)
    assert outcome.status == "failed"
    assert time.monotonic() - began < 5
    shell, _ = read_pids(pids)
    assert group_gone(shell)


@pytest.mark.parametrize("stream", [">&2", ""])
def test_a_failing_scripts_output_names_the_reason(tmp_path, stream):
    body = f'echo "ValueError: no block size $1 here" {stream}\nexit 4'
    outcome = CommandActuator([str(script(tmp_path, body)), "{block_size}"], timeout_s=5).apply(
        64, 32
    )
    assert outcome.status == "failed"
    assert "exited with code 4: ValueError: no block size 64 here" in outcome.reason


def test_a_close_during_a_switch_ends_it_at_once_without_a_rollback(tmp_path):
    """The sidecar's stop closes a restarting actuator first: a script still running is left
    to finish on its own, the switch fails without refusing the size or running the old one."""
    runs = tmp_path / "runs"
    script = tmp_path / "slow.sh"
    script.write_text(f'#!/bin/sh\necho "$1" >> {runs}\nsleep 5\n')
    script.chmod(0o755)
    actuator = CommandActuator([str(script), "{block_size}"], timeout_s=60.0)
    results = []
    switching = threading.Thread(target=lambda: results.append(actuator.apply(32, 16)))
    switching.start()
    deadline = time.monotonic() + 5
    while not runs.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    began = time.monotonic()
    actuator.close()
    switching.join(5)
    assert time.monotonic() - began < 2
    [outcome] = results
    assert outcome.status == "failed"
    assert "stopping" in outcome.reason
    assert actuator.refused == {}
    assert runs.read_text().split() == ["32"]  # the old size was not run
