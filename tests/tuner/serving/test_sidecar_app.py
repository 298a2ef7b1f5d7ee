"""The sidecar's HTTP API on a real uvicorn server: observations in, decisions and metrics out."""

import json
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from blocktune.tuner.config.policy import load_policy
from blocktune.tuner.serving.sidecar_app import create_sidecar_app, router
from blocktune.tuner.sidecar.assembly import build_sidecar
from blocktune.tuner.sidecar.sources import MAX_OBSERVATIONS

# The default policy with a KV budget small enough to fill (384 token slots): there the block
# size matters, and a promotion burst's short requests serve best at B=8.
POLICY = load_policy(Path(__file__).resolve().parents[3] / "policies" / "default.yaml").model_copy(
    update={"kv_budget": 48 * 2**20}
)
TOKEN = "sidecar-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def short_requests(count: int, seed: int = 0) -> list[dict]:
    """A promotion burst: short prompts and answers, one request every 0.2 s."""
    rng = np.random.default_rng(seed)
    return [
        {
            "prompt_tokens": int(p),
            "output_tokens": int(o),
            "timestamp": 1_700_000_000.0 + 0.2 * i,
            "prefix_group": f"faq-{i % 7}",
        }
        for i, (p, o) in enumerate(
            zip(rng.integers(15, 26, count), rng.integers(8, 25, count), strict=True)
        )
    ]


def metrics(url: str) -> dict[str, dict]:
    """`{sample name: {label value or '': value}}` from the exposition."""
    out: dict[str, dict] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            key = next(iter(sample.labels.values()), "")
            out.setdefault(sample.name, {})[key] = sample.value
    return out


def test_observations_decide_recommendation_and_metrics(live_server):
    sidecar = build_sidecar(POLICY)
    with live_server(create_sidecar_app(sidecar, token=TOKEN)) as url:
        assert httpx.get(f"{url}/healthz").json() == {"status": "ok"}
        ready = httpx.get(f"{url}/readyz")
        assert ready.status_code == 200 and ready.json()["scheduler_running"] is True
        before = httpx.get(f"{url}/v1/recommendation").json()
        assert before["block_size"] is None and before["current_block_size"] == 16
        assert before["next_run_at"] is not None

        items = short_requests(300)
        first = httpx.post(f"{url}/v1/observations", json=items[:100], headers=AUTH)
        assert first.json() == {"accepted": 100, "window_requests": 100}
        # The window now holds min_samples (100): the sidecar decides at once, not an
        # interval later.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if "samples" in httpx.get(f"{url}/v1/recommendation").json():
                break
            time.sleep(0.05)
        early = httpx.get(f"{url}/v1/recommendation").json()
        assert early["samples"] == 100 and "gain_interval" in early
        wrapped = httpx.post(
            f"{url}/v1/observations", json={"observations": items[100:]}, headers=AUTH
        )
        assert wrapped.json() == {"accepted": 200, "window_requests": 300}

        window = httpx.get(f"{url}/v1/window").json()
        assert window["count"] == 300 and window["capacity"] == 1000
        prompts = [o["prompt_tokens"] for o in items]
        assert window["prompt_tokens"]["mean"] == pytest.approx(np.mean(prompts))
        assert sum(b["count"] for b in window["histogram"]) == 300

        decided = httpx.post(f"{url}/v1/decide", headers=AUTH)
        assert decided.status_code == 200
        body = decided.json()
        assert body["switch"] is True and body["block_size"] == 8
        assert body["recommended_block_size"] == 8 and body["current_block_size"] == 16
        assert body["action"].startswith("set the block size to 8")
        assert body["reason"].startswith("switch B=16 -> 8")
        assert body["samples"] == 300 and body["window"]["count"] == 300
        assert [c["block_size"] for c in body["candidates"]] == [8, 16, 32, 64, 128]
        assert body["prior_block_size"] in POLICY.candidates
        assert body["decided_at"] > 1e9 and body["next_run_at"] > body["decided_at"]
        assert "actuation" not in body  # no actuator configured
        assert httpx.get(f"{url}/v1/recommendation").json() == body

        m = metrics(url)
        assert m["blocktune_recommended_block_size"][""] == 8
        assert m["blocktune_current_block_size"][""] == 16
        assert m["blocktune_window_requests"][""] == 300
        assert m["blocktune_observations_total"][""] == 300
        assert sum(m["blocktune_decisions_total"].values()) == 2  # at min_samples, then asked
        assert m["blocktune_decision_failures_total"][""] == 0
        assert m["blocktune_source_errors_total"] == {"push": 0}
        padding = m["blocktune_padding_ratio"]
        assert set(padding) == {"8", "16", "32", "64", "128"}
        assert padding["8"] == pytest.approx(body["candidates"][0]["padding_ratio"])
        assert padding["8"] < padding["16"] < padding["128"]
        assert "blocktune_swaps_total" not in m

        schema = httpx.get(f"{url}/openapi.json").json()
        assert {"/v1/observations", "/v1/recommendation", "/v1/decide", "/v1/window"} <= set(
            schema["paths"]
        )
        request_body = schema["paths"]["/v1/observations"]["post"]["requestBody"]
        assert "anyOf" in request_body["content"]["application/json"]["schema"]


def test_the_routes_serve_the_sidecar_of_whichever_app_includes_them():
    app = FastAPI()  # no guards and no lifespan: the routes alone
    app.state.sidecar = build_sidecar(POLICY)
    app.include_router(router)
    with TestClient(app) as client:
        assert client.get("/healthz").json() == {"status": "ok"}
        assert client.get("/v1/window").json()["capacity"] == 1000
        recommendation = client.get("/v1/recommendation").json()
        assert recommendation["reason"] == "no decision yet"
        assert recommendation["current_block_size"] == 16


def test_token_size_and_validation_errors(live_server):
    sidecar = build_sidecar(POLICY)
    with live_server(create_sidecar_app(sidecar, token=TOKEN)) as url:
        one = [{"prompt_tokens": 10, "output_tokens": 5}]
        assert httpx.post(f"{url}/v1/observations", json=one).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert httpx.post(f"{url}/v1/observations", json=one, headers=wrong).status_code == 401
        assert httpx.post(f"{url}/v1/decide").status_code == 401

        too_many = [{"prompt_tokens": 1, "output_tokens": 0}] * (MAX_OBSERVATIONS + 1)
        response = httpx.post(f"{url}/v1/observations", json=too_many, headers=AUTH)
        assert response.status_code == 413
        assert "10000 per call" in response.json()["detail"]
        huge = b"[" + b'{"prompt_tokens": 1, "output_tokens": 1},' * 30_000 + b"{}]"
        response = httpx.post(f"{url}/v1/observations", content=huge, headers=AUTH)
        assert response.status_code == 413 and "bytes" in response.json()["detail"]

        mixed = [
            {"prompt_tokens": 12, "output_tokens": 3},
            {"prompt_tokens": 12, "output_tokens": 3},
            {"prompt_tokens": 0, "output_tokens": 3},
            {"prompt_tokens": 12, "output_tokens": 2.5},
            {"prompt_tokens": 12, "output_tokens": 1, "timestamp": "soon", "extra": 1},
        ]
        response = httpx.post(f"{url}/v1/observations", json=mixed, headers=AUTH)
        assert response.status_code == 422
        errors = {(e["index"], e["field"]) for e in response.json()["errors"]}
        assert errors == {
            (2, "prompt_tokens"),
            (3, "output_tokens"),
            (4, "timestamp"),
            (4, "extra"),
        }
        assert "observations[2].prompt_tokens" in response.json()["detail"]
        assert "nothing was applied" in response.json()["detail"]
        bad_shape = httpx.post(f"{url}/v1/observations", json={"rows": []}, headers=AUTH)
        assert bad_shape.status_code == 422 and "got an object" in bad_shape.json()["detail"]
        json_type = {**AUTH, "content-type": "application/json"}
        not_json = httpx.post(f"{url}/v1/observations", content=b"[{", headers=json_type)
        assert not_json.status_code == 400 and "not standard JSON" in not_json.json()["detail"]
        empty = httpx.post(f"{url}/v1/observations", headers=json_type)
        assert empty.status_code == 400 and "the body is empty" in empty.json()["detail"]

        # Nothing of the rejected batches reached the window; each is a push source error.
        assert httpx.get(f"{url}/v1/window").json()["count"] == 0
        assert metrics(url)["blocktune_source_errors_total"] == {"push": 3}


def test_restart_with_the_state_file_restores_the_window_and_decision(live_server, tmp_path):
    state = tmp_path / "state" / "sidecar.json"
    items = short_requests(250, seed=3)
    first = build_sidecar(POLICY, state_file=state)
    with live_server(create_sidecar_app(first)) as url:
        httpx.post(f"{url}/v1/observations", json=items)
        decided = httpx.post(f"{url}/v1/decide").json()
    saved = json.loads(state.read_text())
    assert saved["current_block_size"] == 16 and len(saved["window"]["prompt_tokens"]) == 250
    assert [p.name for p in state.parent.iterdir()] == ["sidecar.json"]  # no temporary left

    second = build_sidecar(POLICY, state_file=state)
    with live_server(create_sidecar_app(second)) as url:
        window = httpx.get(f"{url}/v1/window").json()
        assert window["count"] == 250
        assert window["prompt_tokens"]["mean"] == pytest.approx(
            np.mean([o["prompt_tokens"] for o in items])
        )
        restored = httpx.get(f"{url}/v1/recommendation").json()
        assert restored["block_size"] == decided["block_size"] == 8
        assert restored["decided_at"] == decided["decided_at"]
    snapshot = second.window.snapshot()
    assert snapshot.timestamps.tolist() == [o["timestamp"] for o in items]
    assert snapshot.shared_prefixes == 250 - 7


def test_a_corrupt_state_file_is_set_aside_and_the_sidecar_starts_fresh(tmp_path, caplog):
    state = tmp_path / "sidecar.json"
    state.write_text('{"version": 1, "window": [1, 2')
    with caplog.at_level("INFO", logger="blocktune.sidecar"):
        sidecar = build_sidecar(POLICY, state_file=state)
    assert len(sidecar.window) == 0 and not state.exists()
    aside = list(tmp_path.glob("sidecar.json.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_text() == '{"version": 1, "window": [1, 2'
    assert sidecar.state_file.set_aside_as == aside[0]
    event = next(json.loads(r.message) for r in caplog.records if "state_file_corrupt" in r.message)
    assert event["file"] == str(state) and "not valid JSON" in event["problem"]

    # Valid JSON that is not a valid state (a non-power-of-two size) is corrupt too.
    sidecar.save_state()
    saved = json.loads(state.read_text())
    state.write_text(json.dumps({**saved, "current_block_size": 12}))
    assert build_sidecar(POLICY, state_file=state).current_block_size == 16
    assert len(list(tmp_path.glob("sidecar.json.corrupt-*"))) == 2
