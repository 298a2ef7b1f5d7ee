"""The supervised vLLM (a fake one, tests/fake_vllm.py) never outlives its sidecar and is
never served twice: a server left by a sidecar killed with SIGKILL is adopted at its real
size, anything else on the port is refused, a server that exits between switches is
started again (within bounds), a stop cuts a start or drain short, refused sizes are kept
on disk and expire, and what vLLM's output says counts only in vLLM's own lines."""

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from blocktune.tuner.config.policy import Policy, load_policy
from blocktune.tuner.operations import NotReady, free_port, wait_until_ready
from blocktune.tuner.sidecar.assembly import build_sidecar
from blocktune.tuner.sidecar.child_process import start_identity
from blocktune.tuner.sidecar.child_record import record_path
from blocktune.tuner.sidecar.restarts import reason_from
from blocktune.tuner.sidecar.sidecar import MAX_WARNED_VALUES
from blocktune.tuner.sidecar.vllm_output import engine_info, exception_message
from blocktune.tuner.sidecar.vllm_process import STOPPING, VllmProcessActuator

ROOT = Path(__file__).resolve().parents[3]
FAKE_VLLM = ROOT / "tests" / "fake_vllm.py"
DEFAULT = ROOT / "policies" / "default.yaml"


def command(port: int, *extra: str, delay: float = 0.2) -> list[str]:
    """The fake vLLM on `port`, `delay` seconds to load."""
    fake = [sys.executable, str(FAKE_VLLM), "--port", str(port), "--block-size", "{block_size}"]
    return [*fake, "--start-delay", str(delay), *extra]


def supervised(port: int, *extra: str, initial: int = 64, delay: float = 0.2, **settings):
    options = {"start_timeout_s": 20.0, "stop_timeout_s": 5.0, "drain_timeout_s": 2.0}
    options.update(settings)
    return VllmProcessActuator(
        command(port, *extra, delay=delay),
        f"http://127.0.0.1:{port}",
        initial_block_size=initial,
        **options,
    )


def started(actuator: VllmProcessActuator) -> VllmProcessActuator:
    actuator.start()
    actuator._settle_first_start()
    return actuator


def running(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    return start_identity(pid) is not None


def events(caplog, name: str) -> list[dict]:
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "blocktune.sidecar"]
    return [line for line in lines if line["event"] == name]


def until(check, timeout_s: float = 30.0, what: str = "the condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what} did not hold within {timeout_s} s")


# ---------------------------------------------------------------------- vLLM's output lines
REQUEST_LOG = "INFO 12-01 10:00:00 [logger.py:43] Received request cmpl-1: prompt: "


def test_only_vllms_own_lines_name_its_platform_backend_and_errors():
    assert engine_info("INFO 12-01 10:00:00 [__init__.py:239] Automatically detected platform cpu.")
    assert engine_info("INFO 12-01 10:00:00 [cuda.py:344] Using FLASH_ATTN attention backend.") == (
        None,
        "FLASH_ATTN",
    )
    config = "(EngineCore_DP0 pid=9) INFO 12-01 10:00:00 [core.py:77] Initializing a V1 LLM "
    assert engine_info(config + "engine (v0.32.0) with config: device_config=cpu, ") == (
        "cpu",
        None,
    )
    assert engine_info("\x1b[32mINFO\x1b[0m 12-01 10:00:00 [cuda.py:1] Using TRITON_ATTN backend")
    # A prompt in vLLM's request log, or a line that is not vLLM's, names nothing.
    for spoof in (
        REQUEST_LOG + "'Using TRITON_ATTN attention backend'",
        REQUEST_LOG + "'x] Automatically detected platform tpu. device_config=tpu'",
        "Using TRITON_ATTN attention backend",
        "INFO Using TRITON_ATTN attention backend",
    ):
        assert engine_info(spoof) == (None, None), spoof
    assert exception_message("ValueError: No common block size for 16") == (
        "ValueError: No common block size for 16"
    )
    logged = "(Worker pid=8) ERROR 12-01 10:00:00 [multiproc_executor.py:1063] OSError: [Errno 98]"
    assert exception_message(logged) == "OSError: [Errno 98]"
    assert exception_message("(EngineCore_DP0 pid=8) RuntimeError: init failed") == (
        "RuntimeError: init failed"
    )
    for spoof in (
        REQUEST_LOG + "'x] ValueError: the size 32 is cursed'",
        "WARNING 12-01 10:00:00 [utils.py:1] ValueError: only a warning",
        "  raise ValueError: inside a traceback's code line",
    ):
        assert exception_message(spoof) is None, spoof
    output = [REQUEST_LOG + "'] KeyError: spoofed'", "ValueError: No common block size for 16"]
    assert reason_from("exited with code 1", output) == (
        "exited with code 1: ValueError: No common block size for 16"
    )


def test_the_values_warned_about_are_bounded(caplog):
    caplog.set_level(logging.INFO, logger="blocktune.sidecar")
    policy = load_policy(DEFAULT)
    vllm = {**policy.model_dump(), "engine": "vllm", "candidates": [16, 32, 64, 128]}
    sidecar = build_sidecar(Policy.model_validate(vllm))
    for number in range(3 * MAX_WARNED_VALUES):
        sidecar.report_engine(None, f"BACKEND_{number}")
    assert sidecar.stats().engine_mismatches["backend"] == 3 * MAX_WARNED_VALUES
    assert len(sidecar._warned) == MAX_WARNED_VALUES
    assert len(events(caplog, "engine_mismatch")) == MAX_WARNED_VALUES


@pytest.mark.slow
def test_prompts_in_the_request_log_cannot_pose_as_vllms_lines(caplog):
    caplog.set_level(logging.INFO, logger="blocktune.sidecar")
    port = free_port()
    seen = []
    extra = ("--log-requests", "--platform", "cuda", "--backend", "FLASH_ATTN")
    actuator = supervised(port, *extra, on_engine_info=lambda *info: seen.append(info))
    try:
        started(actuator)
        for prompt in ("Using TRITON_ATTN attention backend", "x] ValueError: 64 is cursed"):
            body = {"prompt": prompt, "max_tokens": 2}
            httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=10)
        until(lambda: any("cursed" in line for line in actuator._reader.tail))
        assert seen == [("cuda", None), (None, "FLASH_ATTN")]
        assert reason_from("gone", list(actuator._reader.tail)).startswith("gone; its last")
    finally:
        actuator.close()


# ---------------------------------------------------------------------- the fake's output
@pytest.mark.slow
def test_the_fake_vllm_outlives_a_closed_output_as_vllm_does():
    port = free_port()
    argv = [part.replace("{block_size}", "64") for part in command(port, "--log-requests")]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_until_ready(f"http://127.0.0.1:{port}", process, timeout_s=20, path="/health")
        process.stdout.close()  # the sidecar reading it is gone
        body = {"prompt": "a line it cannot write", "max_tokens": 2}
        assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body).status_code == 200
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        assert process.poll() is None
    finally:
        process.kill()
        process.wait()


# ---------------------------------------------------------------------- never served twice
def vllm_policy_file(tmp_path: Path, port: int, *extra: str, delay: float = 0.2) -> Path:
    """A `blocktune serve` policy whose short requests want B=32 of a fake vLLM started at
    128 (vLLM's CPU rule)."""
    policy = yaml.safe_load(DEFAULT.read_text())
    policy.update(
        kv_budget="48MiB",
        engine="vllm",
        vllm_backend="CPU_ATTN",
        candidates=[32, 64, 128],
        mode="enforce",
        server={"initial_block_size": 128},
        actuator={
            "kind": "vllm_process",
            "url": f"http://127.0.0.1:{port}",
            "command": command(port, *extra, delay=delay),
            "start_timeout": "30s",
            "drain_timeout": "2s",
            "stop_timeout": "5s",
        },
    )
    path = tmp_path / "vllm-policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    return path


def short_requests(count: int = 300) -> list[dict]:
    return [
        {"prompt_tokens": 15 + i % 11, "output_tokens": 8 + i % 17, "timestamp": 1e9 + 0.2 * i}
        for i in range(count)
    ]


def serve(policy: Path, state: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "BLOCKTUNE_TOKEN"}
    argv = [sys.executable, "-m", "blocktune.tuner.cli", "serve", "--policy", str(policy)]
    argv += ["--port", str(port), "--state-file", str(state)]
    process = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(url, process, timeout_s=90, path="/readyz")
    except NotReady as error:
        process.kill()
        raise AssertionError(f"{error}: {process.communicate()[0]}") from None
    return process, url


def stopped(process: subprocess.Popen, sig: int) -> list[dict]:
    process.send_signal(sig)
    output, _ = process.communicate(timeout=60)
    return [json.loads(line) for line in output.splitlines() if line.startswith("{")]


@pytest.fixture
def leftovers():
    """Processes (a `Popen`, or the pid of a server's group) a failed test must not leave
    running: `leftovers.append(...)`; each still running is killed at the end."""
    kept: list = []
    yield kept
    for item in kept:
        if isinstance(item, subprocess.Popen):
            item.kill()
            item.wait()
        elif running(item):
            os.killpg(item, signal.SIGKILL)


def recorded_server(state: Path) -> dict | None:
    try:
        return json.loads(record_path(state).read_text())["server"]
    except (OSError, ValueError):
        return None


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def served_size(vllm: str) -> str:
    text = httpx.get(f"{vllm}/metrics").text
    return text.split('block_size="', 1)[1].split('"', 1)[0]


@pytest.mark.slow
def test_a_server_left_by_a_killed_sidecar_is_adopted_switched_and_stopped(tmp_path, leftovers):
    vllm_port = free_port()
    vllm = f"http://127.0.0.1:{vllm_port}"
    policy, state = vllm_policy_file(tmp_path, vllm_port), tmp_path / "state.json"
    first, _ = serve(policy, state)
    orphan = recorded_server(state)["pid"]
    leftovers += [first, orphan]
    first.kill()  # SIGKILL: no stop, no save
    first.wait()
    assert running(orphan) and httpx.get(f"{vllm}/health").status_code == 200

    second, url = serve(policy, state)
    leftovers.append(second)
    try:
        assert recorded_server(state)["pid"] == orphan  # adopted, no second server
        assert httpx.get(f"{url}/readyz").status_code == 200
        assert httpx.post(f"{url}/v1/observations", json=short_requests()).status_code == 200
        body = until(
            lambda: httpx.get(f"{url}/v1/recommendation", timeout=60).json()["actuation"],
            timeout_s=60,
            what="a switch",
        )
        assert body["status"] == "done" and body["new_block_size"] == 32
        assert served_size(vllm) == "32" and not running(orphan)
        server = recorded_server(state)["pid"]
        leftovers.append(server)
    finally:
        lines = stopped(second, signal.SIGHUP)  # a hang-up stops as cleanly as SIGTERM
    assert second.returncode == 0 and lines[-1]["event"] == "sidecar_stopped"
    adopted = next(line for line in lines if line["event"] == "vllm_adopted")
    assert (adopted["pid"], adopted["block_size"]) == (orphan, 128)
    assert not running(server) and recorded_server(state) is None
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{vllm}/health", timeout=1)


@pytest.mark.slow
def test_a_sidecar_killed_mid_restart_is_followed_by_one_that_knows_the_size_served(
    tmp_path, leftovers
):
    vllm_port = free_port()
    vllm = f"http://127.0.0.1:{vllm_port}"
    policy, state = vllm_policy_file(tmp_path, vllm_port, delay=2.0), tmp_path / "state.json"
    first, url = serve(policy, state)
    leftovers += [first, recorded_server(state)["pid"]]
    httpx.post(f"{url}/v1/observations", json=short_requests())  # decides at once: 128 -> 32
    server = until(
        lambda: (s := recorded_server(state)) and s["block_size"] == 32 and s, what="the restart"
    )
    leftovers.append(server["pid"])
    first.kill()  # while the new server loads
    first.wait()
    until(lambda: answers(f"{vllm}/health"), what="the orphan's start")
    assert served_size(vllm) == "32"

    second, url = serve(policy, state)
    leftovers.append(second)
    try:
        assert httpx.get(f"{url}/v1/recommendation").json()["current_block_size"] == 32
        assert recorded_server(state)["pid"] == server["pid"]
    finally:
        lines = stopped(second, signal.SIGTERM)
    assert json.loads(state.read_text())["current_block_size"] == 32
    assert any(line["event"] == "vllm_adopted" for line in lines)
    assert not running(server["pid"])


@pytest.mark.slow
def test_a_server_the_sidecar_did_not_start_is_named_and_never_joined_by_another(caplog):
    caplog.set_level(logging.INFO, logger="blocktune.sidecar")
    port = free_port()
    argv = [part.replace("{block_size}", "64") for part in command(port)]
    stranger = subprocess.Popen(argv, stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until_ready(f"http://127.0.0.1:{port}", stranger, timeout_s=20, path="/health")
        actuator = started(supervised(port))
        try:
            assert actuator._server is None and actuator.block_size() is None
            reason = actuator.down_reason
            assert f"port {port}" in reason and f"pid {stranger.pid}" in reason
            assert "did not start" in reason
            assert not events(caplog, "vllm_serving")
            assert actuator.apply(128, 64).status == "failed"
        finally:
            actuator.close()
        assert stranger.poll() is None  # not ours to stop
    finally:
        stranger.kill()
        stranger.wait()


# ---------------------------------------------------------------------- exits and stops
@pytest.mark.slow
def test_a_server_that_exits_between_switches_is_logged_and_started_again(caplog):
    caplog.set_level(logging.INFO, logger="blocktune.sidecar")
    port = free_port()
    actuator = started(supervised(port, restart_delays_s=(0.1, 0.1)))
    try:
        first = actuator._server.pid
        os.kill(first, signal.SIGKILL)
        exited = until(lambda: events(caplog, "vllm_exited"), timeout_s=5, what="vllm_exited")
        assert (exited[0]["pid"], exited[0]["exit_code"]) == (first, -signal.SIGKILL)
        until(lambda: events(caplog, "vllm_restarted"), timeout_s=20, what="the restart")
        assert actuator.block_size() == 64 and actuator._server.pid != first
        assert actuator.down_reason is None
    finally:
        actuator.close()


@pytest.mark.slow
def test_a_server_that_keeps_exiting_is_restarted_a_bounded_number_of_times(caplog):
    caplog.set_level(logging.INFO, logger="blocktune.sidecar")
    port = free_port()
    actuator = supervised(port, "--exit-after", "1", restart_delays_s=(0.1, 0.1))
    try:
        started(actuator)
        until(lambda: actuator.down_reason, timeout_s=30, what="down")
        assert [e["exit_code"] for e in events(caplog, "vllm_exited")] == [3, 3, 3]
        assert len(events(caplog, "vllm_restarted")) == 2
        assert "restarted 2 times within 600 s already" in actuator.down_reason
        assert events(caplog, "vllm_down")[0]["reason"] == actuator.down_reason
        assert actuator.block_size() is None and actuator._server is None
        outcome = actuator.apply(128, 64)
        assert outcome.status == "failed" and outcome.reason.startswith("vLLM is down")
    finally:
        actuator.close()


@pytest.mark.slow
def test_a_stop_during_a_slow_start_is_quick_and_leaves_no_server():
    port = free_port()
    actuator = supervised(port, delay=60.0)
    actuator.start()
    pid = until(lambda: actuator._server and actuator._server.pid, what="the start")
    began = time.monotonic()
    actuator.close()
    assert time.monotonic() - began < 5
    assert not running(pid) and actuator._server is None
    assert actuator.down_reason is None  # a stop is no failure


@pytest.mark.slow
def test_a_sidecar_stopped_during_a_switch_stops_within_seconds_and_rolls_nothing_back(
    tmp_path, leftovers
):
    port = free_port()
    policy = load_policy(vllm_policy_file(tmp_path, port, "--hang-at", "32"))
    sidecar = build_sidecar(policy, state_file=tmp_path / "state.json")
    sidecar.start()
    sidecar.actuator._settle_first_start()
    leftovers.append(sidecar.actuator._server.pid)
    sidecar.push(short_requests())  # decides at once: 128 -> 32, which never answers
    hanging = until(
        lambda: (
            (s := sidecar.actuator._server)
            and sidecar.actuator.record.server.block_size == 32
            and s.pid
        ),
        what="the switch's start",
    )
    leftovers.append(hanging)
    began = time.monotonic()
    sidecar.stop()
    assert time.monotonic() - began < 8
    assert not running(hanging) and sidecar.actuator._server is None
    actuation = json.loads((tmp_path / "state.json").read_text())["actuation"]
    assert actuation["status"] == "failed" and actuation["reason"].endswith(STOPPING)
    assert sidecar.actuator.record.refusal(32) is None  # a stop is no refusal
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)


@pytest.mark.slow
def test_a_server_killed_mid_drain_ends_the_drain_at_once():
    port = free_port()
    actuator = started(supervised(port, "--busy-for", "600", drain_timeout_s=20.0))
    try:
        pid = actuator._server.pid
        outcome = {}
        switch = threading.Thread(target=lambda: outcome.update(done=actuator.apply(128, 64)))
        switch.start()
        time.sleep(1.0)  # draining: one request counts as running for 600 s
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        switch.join(30)
        assert time.monotonic() - killed < 5
        done = outcome["done"]
        assert done.status == "done" and "exited during the drain" in done.reason
        assert actuator.block_size() == 128
    finally:
        actuator.close()


# ---------------------------------------------------------------------- refused sizes
@pytest.mark.slow
def test_refused_sizes_are_kept_beside_the_state_and_expire(tmp_path):
    port = free_port()
    record = record_path(tmp_path / "state.json")
    first = started(supervised(port, record_file=record, refusal_ttl_s=600.0))
    try:
        assert first.apply(16, 64).status == "rolled_back"
    finally:
        first.close()
    saved = json.loads(record.read_text())
    assert saved["server"] is None
    assert "No common block size for 16" in saved["refused"]["16"]["reason"]
    assert abs(saved["refused"]["16"]["at"] - time.time()) < 60
    second = started(supervised(port, record_file=record, refusal_ttl_s=600.0))
    try:
        again = second.apply(16, 64)
        assert again.status == "rejected" and "did not start with 16 before" in again.reason
    finally:
        second.close()
    saved["refused"]["16"]["at"] -= 601  # older than the refusal's time to live
    record.write_text(json.dumps(saved))
    third = started(supervised(port, record_file=record, refusal_ttl_s=600.0))
    try:
        assert third.apply(16, 64).status == "rolled_back"  # tried again
    finally:
        third.close()


def test_the_policy_sets_how_long_a_refusal_holds_and_where_the_record_lives(tmp_path):
    policy = load_policy(vllm_policy_file(tmp_path, free_port()))
    assert policy.actuator.refusal_ttl.total_seconds() == 3600
    settings = {**policy.actuator.model_dump(), "refusal_ttl": "10m"}
    policy = Policy.model_validate({**policy.model_dump(), "actuator": settings})
    sidecar = build_sidecar(policy, state_file=tmp_path / "state.json")
    assert sidecar.actuator.record.refusal_ttl_s == 600
    assert sidecar.actuator.record.path == tmp_path / "state.json.vllm.json"
    assert build_sidecar(policy).actuator.record.path is None
