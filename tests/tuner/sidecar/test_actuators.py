"""Actuators: a fake worker over real HTTP (retries, rejected swaps) and an in-process engine."""

import contextlib
import json
import socket
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse

from blocktune.tuner.config.policy import ActuatorSettings, WindowSettings, load_policy
from blocktune.tuner.serving.http import BearerAuth
from blocktune.tuner.serving.sidecar_app import create_sidecar_app
from blocktune.tuner.sidecar.actuators import HttpActuator
from blocktune.tuner.sidecar.assembly import SidecarConfigError, build_sidecar
from blocktune.tuner.sidecar.sidecar import Sidecar
from blocktune.tuner.sidecar.state import StateFile

# The default policy with a KV budget small enough to fill (384 token slots): there the block
# size matters, and a promotion burst's short requests serve best at B=8.
POLICY = load_policy(Path(__file__).resolve().parents[3] / "policies" / "default.yaml").model_copy(
    update={"kv_budget": 48 * 2**20}
)
TOKEN = "worker-admin-token"


def fake_worker(state: dict) -> FastAPI:
    """The worker's admin surface: 503 for the first `fail` swaps, then `status` answers."""
    app = FastAPI()

    @app.post("/admin/block-size", dependencies=[Depends(BearerAuth(TOKEN))])
    async def block_size(body: dict):
        state["calls"].append(body)
        if len(state["calls"]) <= state["fail"]:
            return JSONResponse({"detail": "engine loop busy"}, status_code=503)
        old, new = state["block_size"], body["block_size"]
        if state["status"] == "done":
            state["block_size"] = new
        return {
            "status": state["status"],
            "old_block_size": old,
            "new_block_size": state.get("answer", new),
            "zero_copy_blocks": 12 if state["status"] == "done" else 0,
            "copied_blocks": 0,
            "bytes_moved": 0,
            "pause_s": 0.002,
            "reason": state.get(
                "reason", "" if state["status"] == "done" else "request 3 may hold 900 tokens"
            ),
        }

    @app.get("/admin/state")
    async def admin_state():
        return {"block_size": state.get("report", state["block_size"]), "running": 0}

    return app


def short_requests(count: int) -> list[dict]:
    rng = np.random.default_rng(5)
    return [
        {"prompt_tokens": int(p), "output_tokens": int(o), "timestamp": 1e9 + 0.2 * i}
        for i, (p, o) in enumerate(
            zip(rng.integers(15, 26, count), rng.integers(8, 25, count), strict=True)
        )
    ]


def enforcing(url: str) -> object:
    settings = ActuatorSettings(
        kind="http", url=url, token_env="BLOCKTUNE_TEST_WORKER_TOKEN", retries=3, backoff="10ms"
    )
    return POLICY.model_copy(update={"mode": "enforce", "actuator": settings})


def swaps(url: str) -> str:
    text = httpx.get(f"{url}/metrics").text
    return "\n".join(line for line in text.splitlines() if line.startswith("blocktune_swaps"))


def first_decision(url: str, sidecar: Sidecar) -> dict:
    """The recommendation after the decision the sidecar makes once its window holds
    min_samples (it runs on the scheduler's thread: wait for it, 30 s at most)."""
    deadline = time.monotonic() + 30
    while sidecar.scheduler.runs == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    return httpx.get(f"{url}/v1/recommendation").json()


def test_transient_failures_are_retried_and_the_switch_recorded(live_server, monkeypatch, tmp_path):
    monkeypatch.setenv("BLOCKTUNE_TEST_WORKER_TOKEN", TOKEN)
    worker = {"calls": [], "fail": 2, "status": "done", "block_size": 16}
    with live_server(fake_worker(worker)) as worker_url:
        sidecar = build_sidecar(enforcing(worker_url), state_file=tmp_path / "state.json")
        with live_server(create_sidecar_app(sidecar)) as url:
            httpx.post(f"{url}/v1/observations", json=short_requests(300))
            body = first_decision(url, sidecar)  # made as the window reached min_samples
            assert body["switch"] is True and body["enforcing"] is True
            assert worker["calls"] == [{"block_size": 8}] * 3
            actuation = body["actuation"]
            assert actuation["status"] == "done" and actuation["attempts"] == 3
            assert actuation["old_block_size"] == 16 and actuation["new_block_size"] == 8
            assert actuation["zero_copy_blocks"] == 12
            assert actuation["target"] == f"{worker_url}/admin/block-size"
            assert body["current_block_size"] == 8 and body["action"] is None
            assert sidecar.selector.last_switch == body["decided_at"]
            # Saved with this switch's time at once: a crash now keeps min_dwell.
            saved_now = json.loads((tmp_path / "state.json").read_text())
            assert saved_now["last_switch_at"] == body["decided_at"]
            assert 'blocktune_swaps_total{status="done"} 1.0' in swaps(url)
            assert 'blocktune_swaps_total{status="failed"} 0.0' in swaps(url)
            # The next decision starts from the worker's new size and keeps it.
            again = httpx.post(f"{url}/v1/decide").json()
            assert again["switch"] is False and again["decided_current_block_size"] == 8
            assert len(worker["calls"]) == 3
    saved = json.loads((tmp_path / "state.json").read_text())
    assert saved["actuation"]["status"] == "done" and saved["current_block_size"] == 8
    assert saved["last_switch_at"] == body["decided_at"]


def test_a_rejected_swap_is_recorded_and_no_switch_is(live_server, monkeypatch):
    monkeypatch.setenv("BLOCKTUNE_TEST_WORKER_TOKEN", TOKEN)
    worker = {"calls": [], "fail": 0, "status": "rejected", "block_size": 16}
    with live_server(fake_worker(worker)) as worker_url:
        sidecar = build_sidecar(enforcing(worker_url))
        with live_server(create_sidecar_app(sidecar)) as url:
            httpx.post(f"{url}/v1/observations", json=short_requests(300))
            body = first_decision(url, sidecar)
            assert body["actuation"]["status"] == "rejected"
            assert body["actuation"]["reason"] == "request 3 may hold 900 tokens"
            assert body["current_block_size"] == 16
            assert body["action"] == "swap the block size to 8"
            assert sidecar.selector.last_switch is None
            assert 'blocktune_swaps_total{status="rejected"} 1.0' in swaps(url)
            # No dwell started: the next interval tries again.
            assert httpx.post(f"{url}/v1/decide").json()["switch"] is True
            assert len(worker["calls"]) == 2


def test_a_reason_of_megabytes_is_cut_and_the_state_loads_back(live_server, monkeypatch, tmp_path):
    monkeypatch.setenv("BLOCKTUNE_TEST_WORKER_TOKEN", TOKEN)
    worker = {"calls": [], "fail": 0, "status": "rolled_back", "block_size": 16}
    worker["reason"] = "r" * 3_000_000
    path = tmp_path / "state.json"
    with live_server(fake_worker(worker)) as worker_url:
        policy = enforcing(worker_url)
        sidecar = build_sidecar(policy, state_file=path)
        sidecar.push(short_requests(400))
        assert sidecar.decide() is not None
        reason = sidecar.last_actuation["reason"]
        assert reason == "r" * 1000 + "… (2999000 more)"
        assert sidecar.stats().state_save_failures == 0
    assert path.stat().st_size <= StateFile.byte_limit(policy)
    restored = build_sidecar(policy, state_file=path)
    assert len(restored.window) == 400 and restored.last_actuation["reason"] == reason
    assert list(tmp_path.iterdir()) == [path]  # nothing set aside


def test_http_actuator_final_and_exhausted_failures(live_server):
    worker = {"calls": [], "fail": 0, "status": "done", "block_size": 16}
    with live_server(fake_worker(worker)) as worker_url:
        unauthorised = HttpActuator(worker_url, "wrong", retries=3, backoff_s=0.01)
        result = unauthorised.apply(32, 16)
        assert result.status == "failed" and result.attempts == 1  # a 401 is not retried
        assert "token" in result.reason and worker["block_size"] == 16
        assert unauthorised.block_size() == 16
        unauthorised.close()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    delays = []
    down = HttpActuator(f"http://127.0.0.1:{port}", TOKEN, retries=3, sleep=delays.append)
    result = down.apply(32, 16)
    assert result.status == "failed" and result.attempts == 4
    assert "ConnectError" in result.reason and delays == [0.5, 1.0, 2.0]
    assert down.block_size() is None
    down.close()


@pytest.mark.parametrize("answer", [24, 2**70])
def test_an_answer_of_another_size_than_asked_is_not_trusted(live_server, monkeypatch, answer):
    monkeypatch.setenv("BLOCKTUNE_TEST_WORKER_TOKEN", TOKEN)
    worker = {"calls": [], "fail": 0, "status": "done", "block_size": 16, "answer": answer}
    with live_server(fake_worker(worker)) as worker_url:
        sidecar = build_sidecar(enforcing(worker_url))
        sidecar.push(short_requests(300))
        decision = sidecar.decide()
        assert decision is not None and decision.switch and decision.block_size == 8
        actuation = sidecar.last_actuation
        assert actuation["status"] == "failed"
        assert actuation["reason"] == f"the worker reports a swap to {answer}, not to 8"
        assert sidecar.current_block_size == 16 and sidecar.selector.last_switch is None
        worker["report"] = answer  # the size in force it reports: no valid block size either
        assert HttpActuator(worker_url, TOKEN).block_size() is None


def test_readiness_follows_the_actuator_and_shows_its_last_swap(live_server, monkeypatch):
    monkeypatch.setenv("BLOCKTUNE_TEST_WORKER_TOKEN", TOKEN)
    worker = {"calls": [], "fail": 0, "status": "done", "block_size": 16}
    with contextlib.ExitStack() as stack:
        worker_url = stack.enter_context(live_server(fake_worker(worker)))
        sidecar = build_sidecar(enforcing(worker_url))
        with live_server(create_sidecar_app(sidecar)) as url:
            ready = httpx.get(f"{url}/readyz")
            assert ready.status_code == 200
            assert ready.json()["actuator"] == {
                "target": f"{worker_url}/admin/block-size",
                "answers": True,
                "last_swap": None,
                "last_reason": None,
            }
            stack.close()  # the worker goes down
            httpx.post(f"{url}/v1/observations", json=short_requests(300))
            assert httpx.post(f"{url}/v1/decide").json()["actuation"]["status"] == "failed"
            down = httpx.get(f"{url}/readyz")
            assert down.status_code == 503 and down.json()["ready"] is False
            actuator = down.json()["actuator"]
            assert actuator["answers"] is False and actuator["last_swap"] == "failed"
            assert "ConnectError" in actuator["last_reason"]


def test_in_process_engine_swaps_when_the_window_shifts():
    from blocktune.runtime.config import EngineConfig
    from blocktune.runtime.engine import Engine
    from blocktune.runtime.loading import load_weights
    from blocktune.runtime.sampling import SamplingParams

    engine = Engine(load_weights("tiny-random"), EngineConfig(block_size=16, num_blocks=256))
    policy = POLICY.model_copy(
        update={
            "mode": "enforce",
            "window": WindowSettings(capacity=200, min_samples=40),
            "kv_budget": 16 * 2**20,  # 128 slots for requests of 10-18 tokens
        }
    )
    sidecar = build_sidecar(policy, engine=engine)
    assert sidecar.enforcing and sidecar.current_block_size == 16
    rng = np.random.default_rng(0)
    stop = threading.Event()

    def serve() -> None:  # the owner's loop: short requests, one batch after another
        while not stop.is_set():
            prompts = [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(4, 12, 8)]
            engine.generate(prompts, SamplingParams(max_tokens=6))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        while len(sidecar.window) < 60:
            stop.wait(0.01)
        decision = sidecar.decide()
    finally:
        stop.set()
        thread.join(timeout=60)
    assert decision.switch and decision.current_block_size == 16
    assert engine.block_size == decision.block_size == 8
    assert sidecar.last_actuation["status"] == "done"
    assert sidecar.last_actuation["target"] == "engine"
    assert sidecar.current_block_size == 8
    assert sidecar.selector.last_switch == decision.decided_at
    assert sidecar.stats().swaps["done"] == 1
    assert sidecar.statuses["engine"].samples == len(sidecar.window) >= 60
    engine.blocks.check()


def test_an_engine_and_an_http_actuator_exclude_each_other():
    settings = ActuatorSettings(kind="http", url="http://127.0.0.1:9")
    with pytest.raises(SidecarConfigError, match="use one of them"):
        build_sidecar(POLICY.model_copy(update={"actuator": settings}), engine=object())


def test_the_sidecar_swaps_a_real_worker(live_server, monkeypatch):
    from blocktune.runtime.config import EngineConfig
    from blocktune.runtime.engine import Engine
    from blocktune.runtime.engine_loop import EngineLoop
    from blocktune.runtime.loading import load_weights
    from blocktune.runtime.tokenizer import Tokenizer
    from blocktune.tuner.serving.worker_app import create_worker_app

    monkeypatch.setenv("BLOCKTUNE_TEST_WORKER_TOKEN", TOKEN)
    loop = EngineLoop(
        Engine(load_weights("tiny-random"), EngineConfig(block_size=16, num_blocks=256))
    )
    loop.start()
    try:
        with live_server(
            create_worker_app(
                loop, model_name="tiny-random", tokenizer=Tokenizer.byte_level(), token=TOKEN
            )
        ) as worker_url:
            sidecar = build_sidecar(enforcing(worker_url))
            with live_server(create_sidecar_app(sidecar)) as url:
                httpx.post(f"{url}/v1/observations", json=short_requests(300))
                body = httpx.post(f"{url}/v1/decide").json()
            state = httpx.get(f"{worker_url}/admin/state").json()
    finally:
        loop.stop()
    assert body["actuation"]["status"] == "done" and body["current_block_size"] == 8
    assert state["block_size"] == 8 and state["swap_history"][-1]["new_block_size"] == 8
