"""Restart actuators against a fake vLLM (tests/fake_vllm.py) and a user's script: a switch,
a refused size rolled back, a start timeout, the drain timeout, SIGKILL after the stop
timeout, and a server that never came up; each a clear outcome, none an exception."""

import json
import logging
import stat
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from blocktune.tuner.config.policy import ActuatorSettings, Policy, load_policy
from blocktune.tuner.config.vllm_backends import BACKEND_LINE, PLATFORM_LINE
from blocktune.tuner.operations import free_port
from blocktune.tuner.serving.sidecar_app import create_sidecar_app
from blocktune.tuner.sidecar.assembly import build_sidecar
from blocktune.tuner.sidecar.command_actuator import CommandActuator
from blocktune.tuner.sidecar.restarts import fill_block_size, reason_from, requests_in_flight
from blocktune.tuner.sidecar.vllm_process import VllmProcessActuator

FAKE_VLLM = Path(__file__).resolve().parents[2] / "fake_vllm.py"
sys.path.insert(0, str(FAKE_VLLM.parent))
from fake_vllm import metrics_text  # noqa: E402


def fake_command(port: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        str(FAKE_VLLM),
        "--port",
        str(port),
        "--block-size",
        "{block_size}",
        "--start-delay",
        "0.2",
        *extra,
    ]


def supervised(port: int, *extra: str, initial: int = 64, **settings) -> VllmProcessActuator:
    options = {"start_timeout_s": 20.0, "stop_timeout_s": 5.0, "drain_timeout_s": 2.0}
    options.update(settings)
    return VllmProcessActuator(
        fake_command(port, *extra),
        f"http://127.0.0.1:{port}",
        initial_block_size=initial,
        **options,
    )


def started(actuator: VllmProcessActuator) -> VllmProcessActuator:
    actuator.start()
    actuator._settle_first_start()
    return actuator


def events(caplog, name: str) -> list[dict]:
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "blocktune.sidecar"]
    return [line for line in lines if line["event"] == name]


def test_the_command_gets_the_block_size_and_in_flight_requests_are_counted():
    assert fill_block_size(["serve", "--block-size", "{block_size}", "-x={block_size}"], 64) == [
        "serve",
        "--block-size",
        "64",
        "-x=64",
    ]
    assert requests_in_flight(metrics_text(32, 3)) == 3
    assert requests_in_flight(metrics_text(32, 0)) == 0
    # vLLM 0.32.0's CPU build names its platform only in the engine's configuration line.
    engine_line = "INFO [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: "
    assert (
        PLATFORM_LINE.search(engine_line + "kv_cache_dtype=auto, device_config=cpu, ").group(1)
        == "cpu"
    )
    output = [
        "WARNING [system_utils.py:255] ... fd limit errors like `OSError: [Errno 24] Too many`",
        "(Worker pid=8) ERROR [multiproc_executor.py:1063] ValueError: No common block size "
        "for 16 (CPU_ATTN: [MultipleOf(32)]).",
        "RuntimeError: Engine core initialization failed. See root cause above.",
    ]
    assert reason_from("exited with code 1", output) == (
        "exited with code 1: ValueError: No common block size for 16 (CPU_ATTN: [MultipleOf(32)])."
    )
    assert reason_from("gone", ["bye"]) == "gone; its last output: bye"
    assert BACKEND_LINE.search("INFO Using FLASH_ATTN attention backend out of").group(1) == (
        "FLASH_ATTN"
    )


def test_actuator_settings_need_their_parts_and_a_placeholder():
    with pytest.raises(ValueError, match="needs the server's url"):
        ActuatorSettings(kind="vllm_process", command=["vllm", "{block_size}"])
    with pytest.raises(ValueError, match="needs a command"):
        ActuatorSettings(kind="command")
    with pytest.raises(ValueError, match=r"never says \{block_size\}"):
        ActuatorSettings(kind="command", command=["restart-vllm.sh", "32"])
    with pytest.raises(ValueError, match="command is set but kind is http"):
        ActuatorSettings(kind="http", url="http://127.0.0.1:1", command=["x", "{block_size}"])


@pytest.mark.slow
def test_a_switch_restarts_vllm_and_a_refused_size_rolls_back(caplog):
    caplog.set_level(logging.INFO, logger="blocktune.sidecar")
    port = free_port()
    seen = []
    actuator = supervised(port)
    actuator._on_info = lambda platform, backend: seen.append((platform, backend))
    try:
        started(actuator)
        assert actuator.block_size() == 64
        assert seen == [("cpu", None)]
        first_pid = actuator._server.pid
        done = actuator.apply(128, 64)
        assert (done.status, done.old_block_size, done.new_block_size) == ("done", 64, 128)
        assert done.pause_s > 0.2  # the fake's start delay: a measured restart
        assert actuator.block_size() == 128 and actuator._server.pid != first_pid
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'block_size="128"' in text
        # 16 is no multiple of 32 (vLLM's CPU rule): the fake exits, 128 comes back.
        refused = actuator.apply(16, 128)
        assert refused.status == "rolled_back"
        assert "exited with code 1" in refused.reason
        assert "No common block size for 16 (CPU_ATTN: [MultipleOf(32)])" in refused.reason
        assert actuator.block_size() == 128
        assert events(caplog, "vllm_block_size_refused")[0]["block_size"] == 16
        # Asked again, the size is rejected at once: no restart every interval.
        pid = actuator._server.pid
        again = actuator.apply(16, 128)
        assert again.status == "rejected" and "did not start with 16 before" in again.reason
        assert actuator._server.pid == pid
    finally:
        actuator.close()
    assert actuator._server is None
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)


@pytest.mark.slow
def test_a_start_that_never_answers_rolls_back_and_a_busy_server_is_drained_up_to_the_timeout(
    caplog,
):
    caplog.set_level(logging.INFO, logger="blocktune.sidecar")
    port = free_port()
    actuator = supervised(
        port, "--hang-at", "32", "--busy-for", "600", start_timeout_s=3.0, drain_timeout_s=0.5
    )
    try:
        started(actuator)
        outcome = actuator.apply(32, 64)
        assert outcome.status == "rolled_back"
        assert "did not answer 200 within 3 s" in outcome.reason
        assert actuator.block_size() == 64
        drained = events(caplog, "vllm_drain_timeout")
        assert drained and drained[0]["in_flight"] == 1
        # The drain note rides on a switch that worked.
        done = actuator.apply(128, 64)
        assert done.status == "done"
        assert "1 requests were still in flight after the drain timeout (0.5 s)" in done.reason
    finally:
        actuator.close()


@pytest.mark.slow
def test_a_server_ignoring_sigterm_is_killed_and_one_that_never_came_up_is_reported(caplog):
    caplog.set_level(logging.INFO, logger="blocktune.sidecar")
    port = free_port()
    stubborn = started(supervised(port, "--ignore-sigterm", stop_timeout_s=0.5))
    assert stubborn.down_reason is None
    process = stubborn._server
    stubborn.close()
    assert not process.alive()
    assert events(caplog, "vllm_stop_timeout")
    # The initial size is refused: the server is down, switches fail, nothing restarts it.
    down = started(supervised(free_port(), initial=16))
    try:
        assert down.block_size() is None
        assert "No common block size for 16" in down.down_reason
        assert "No common block size for 16" in events(caplog, "vllm_start_failed")[0]["reason"]
        outcome = down.apply(64, 16)
        assert outcome.status == "failed" and outcome.reason.startswith("vLLM is down")
    finally:
        down.close()


def script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "restart-vllm.sh"
    path.write_text(f"#!/bin/sh\n{body}\n", encoding="utf-8")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_a_users_command_applies_the_size_and_rolls_back_when_it_fails(tmp_path):
    record = tmp_path / "sizes"
    restart = script(
        tmp_path, f'echo "$1" >> {record}\nif [ "$1" = 16 ]; then echo "no 16 here" >&2; exit 3; fi'
    )
    actuator = CommandActuator([str(restart), "{block_size}"], timeout_s=10)
    assert actuator.block_size() is None
    done = actuator.apply(64, 32)
    assert done.status == "done" and actuator.block_size() == 64
    refused = actuator.apply(16, 64)
    assert refused.status == "rolled_back"
    assert "exited with code 3" in refused.reason and "no 16 here" in refused.reason
    assert record.read_text().split() == ["64", "16", "64"]
    assert actuator.apply(16, 64).status == "rejected"
    assert record.read_text().split() == ["64", "16", "64"]


def test_a_command_failing_for_both_sizes_or_timing_out_is_a_failure(tmp_path):
    failing = CommandActuator([str(script(tmp_path, "exit 1")), "{block_size}"], timeout_s=10)
    outcome = failing.apply(64, 32)
    assert outcome.status == "failed" and "the old size 32 failed too" in outcome.reason
    slow = CommandActuator([str(script(tmp_path, "sleep 30")), "{block_size}"], timeout_s=0.3)
    began = time.monotonic()
    outcome = slow.apply(64, 32)
    assert outcome.status == "failed" and "did not finish within 0.3 s" in outcome.reason
    assert time.monotonic() - began < 10
    missing = CommandActuator([str(tmp_path / "nope"), "{block_size}"]).apply(64, 32)
    assert missing.status == "failed" and "cannot run" in missing.reason


def vllm_policy(port: int, *extra: str, tmp_path: Path) -> Policy:
    """vLLM's CPU rule, a budget small enough that short requests want B=32, and the fake
    vLLM as the sidecar's child."""
    base = load_policy(Path(__file__).resolve().parents[3] / "policies" / "default.yaml")
    return Policy.model_validate(
        {
            **base.model_dump(),
            "kv_budget": 48 * 2**20,
            "engine": "vllm",
            "vllm_backend": "CPU_ATTN",
            "candidates": [32, 64, 128],
            "mode": "enforce",
            "server": {"initial_block_size": 128},
            "actuator": {
                "kind": "vllm_process",
                "url": f"http://127.0.0.1:{port}",
                "command": fake_command(port, *extra),
                "start_timeout": "20s",
                "drain_timeout": "2s",
                "log_file": str(tmp_path / "vllm.log"),
            },
        }
    )


def short_requests(count: int) -> list[dict]:
    rng = np.random.default_rng(5)
    prompts, outputs = rng.integers(15, 26, count), rng.integers(8, 25, count)
    return [
        {"prompt_tokens": int(p), "output_tokens": int(o), "timestamp": 1e9 + 0.2 * i}
        for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))
    ]


@pytest.mark.slow
def test_the_sidecar_restarts_its_vllm_and_prices_switches_at_the_measured_restart(
    tmp_path, caplog
):
    caplog.set_level(logging.INFO, logger="blocktune.sidecar")
    port = free_port()
    sidecar = build_sidecar(
        vllm_policy(port, tmp_path=tmp_path), state_file=tmp_path / "state.json"
    )
    sidecar.start()
    try:
        # The CPU backend priced with the L4 calibration: warned at start, no device named.
        assert (
            "a CPU (vLLM's CPU_ATTN backend)"
            in events(caplog, "calibration_for_another_device")[0]["warning"]
        )
        sidecar.push(short_requests(300))
        decision = sidecar.decide()
        assert decision.switch and decision.block_size == 32
        actuation = sidecar.last_actuation
        assert actuation["status"] == "done" and actuation["new_block_size"] == 32
        assert sidecar.current_block_size == 32 and sidecar.actuator.block_size() == 32
        stats = sidecar.stats()
        assert list(stats.restarts_s) == [actuation["pause_s"]]
        # Was 60 s; a timedelta holds the measured restart to the microsecond.
        assert stats.switch_cost_s == pytest.approx(actuation["pause_s"], abs=1e-6)
        assert sidecar.selector.last_switch == decision.decided_at
        assert "serving block size 32" in (tmp_path / "vllm.log").read_text()
        # The platform the log names is checked against the calibration, once.
        assert stats.engine_mismatches["device"] >= 1
    finally:
        sidecar.stop()
    saved = json.loads((tmp_path / "state.json").read_text())
    assert saved["current_block_size"] == 32 and saved["actuation"]["status"] == "done"
    assert saved["restarts_s"] == [actuation["pause_s"]]
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
    # A sidecar started again on the state file pays back the measured restart at once.
    again = build_sidecar(vllm_policy(port, tmp_path=tmp_path), state_file=tmp_path / "state.json")
    assert again.stats().switch_cost_s == pytest.approx(actuation["pause_s"], abs=1e-6)


def test_measured_restarts_survive_a_restart_of_the_sidecar(tmp_path):
    policy = vllm_policy(free_port(), tmp_path=tmp_path)
    state = tmp_path / "state.json"
    first = build_sidecar(policy, state_file=state)
    assert first.stats().switch_cost_s == 60.0  # the policy's restart before any
    for seconds in (80.0, 75.9, 140.0):
        first._measured_restart(seconds)
    first.save_state()
    assert json.loads(state.read_text())["restarts_s"] == [80.0, 75.9, 140.0]
    second = build_sidecar(policy, state_file=state)
    assert list(second.stats().restarts_s) == [80.0, 75.9, 140.0]
    assert second.stats().switch_cost_s == pytest.approx(80.0)  # their median
    # A policy whose switches are not restarts does not price them.
    swaps = Policy.model_validate({**policy.model_dump(), "actuator": {"kind": "none"}})
    assert not build_sidecar(swaps, state_file=state).stats().restarts_s


def test_a_state_with_a_negative_restart_is_set_aside(tmp_path):
    policy = vllm_policy(free_port(), tmp_path=tmp_path)
    state = tmp_path / "state.json"
    sidecar = build_sidecar(policy, state_file=state)
    sidecar.save_state()
    data = json.loads(state.read_text())
    state.write_text(json.dumps({**data, "restarts_s": [-1.0]}))
    again = build_sidecar(policy, state_file=state)
    assert not again.stats().restarts_s
    assert again.state_file.set_aside_as is not None


@pytest.mark.slow
def test_a_size_the_server_refuses_rolls_back_once_and_is_then_rejected(tmp_path, live_server):
    port = free_port()
    # This server's backend takes multiples of 64 only, and names itself FLASH_ATTN.
    extra = ("--multiple", "64", "--platform", "cuda", "--backend", "FLASH_ATTN")
    sidecar = build_sidecar(vllm_policy(port, *extra, tmp_path=tmp_path), state_file=tmp_path / "s")
    with live_server(create_sidecar_app(sidecar)) as url:
        httpx.post(f"{url}/v1/observations", json=short_requests(300))
        # The window reached min_samples: the first decision runs at once, on its own.
        deadline = time.monotonic() + 120
        while sidecar.scheduler.runs == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        body = httpx.get(f"{url}/v1/recommendation", timeout=60).json()
        assert body["switch"] is True
        actuation = body["actuation"]
        assert actuation["status"] == "rolled_back"
        assert "No common block size for 32 (FLASH_ATTN: [MultipleOf(64)])" in actuation["reason"]
        assert body["current_block_size"] == 128 and sidecar.selector.last_switch is None
        saved = json.loads((tmp_path / "s").read_text())
        assert saved["actuation"]["status"] == "rolled_back" and saved["current_block_size"] == 128
        pid = sidecar.actuator._server.pid
        again = httpx.post(f"{url}/v1/decide", timeout=60).json()
        assert again["actuation"]["status"] == "rejected"
        assert sidecar.actuator._server.pid == pid
        exposition = httpx.get(f"{url}/metrics").text
        assert 'blocktune_swaps_total{status="rolled_back"} 1.0' in exposition
        assert 'blocktune_swaps_total{status="rejected"} 1.0' in exposition
        assert 'blocktune_engine_mismatches_total{kind="backend"} ' in exposition
        assert 'blocktune_engine_mismatches_total{kind="device"} 0.0' in exposition
        assert "blocktune_switch_cost_seconds 60.0" in exposition
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
