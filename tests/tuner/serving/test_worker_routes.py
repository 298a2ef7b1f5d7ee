"""The worker's route handlers alone: each on a bare app holding only the state it reads."""

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from blocktune.runtime.config import EngineConfig
from blocktune.runtime.engine import Engine
from blocktune.runtime.engine_loop import EngineLoop
from blocktune.runtime.loading import load_weights
from blocktune.tuner.serving import admin_routes, openai_routes
from blocktune.tuner.serving.http import BearerAuth
from blocktune.tuner.serving.openai_api import ServedModel
from blocktune.tuner.serving.worker_errors import add_error_handlers


@pytest.fixture(scope="module")
def stopped_loop():
    """An engine loop never started: its state is the engine's as built, with no steps."""
    config = EngineConfig(block_size=16, num_blocks=32, candidate_block_sizes=(8, 16))
    return EngineLoop(Engine(load_weights("tiny-random", seed=0), config))


def test_the_models_handler_reads_only_the_served_model():
    app = FastAPI()
    app.state.served = ServedModel("alone", None, max_model_len=96, created=7)
    app.include_router(openai_routes.router)
    with TestClient(app) as client:
        listed = client.get("/v1/models").json()
        one = client.get("/v1/models/alone").json()
    card = {
        "id": "alone",
        "object": "model",
        "created": 7,
        "owned_by": "blocktune",
        "max_model_len": 96,
    }
    assert listed == {"object": "list", "data": [card]}
    assert one == card


def test_the_admin_handlers_read_only_the_engine_loop(stopped_loop):
    app = FastAPI()
    add_error_handlers(app)
    app.state.loop = stopped_loop
    app.include_router(admin_routes.block_size_router((8, 16), BearerAuth(None)))
    app.include_router(admin_routes.router)
    with TestClient(app) as client:
        state = client.get("/admin/state").json()
        health = client.get("/health")
        refused = client.post("/admin/block-size", json={"block_size": 32})
    assert (state["block_size"], state["blocks_total"], state["steps"]) == (16, 32, 0)
    assert state["swap_history"] == []
    assert health.status_code == 503
    assert health.json()["error"]["message"] == "the engine is not running"
    assert refused.status_code == 422
    assert refused.json()["error"] == {
        "message": "block_size 32 is not one of this worker's candidate block sizes [8, 16]",
        "type": "invalid_request_error",
        "param": "block_size",
        "code": None,
    }
