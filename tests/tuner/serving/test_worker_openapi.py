"""The worker's OpenAPI document says exactly what it serves: the methods of each path (and a
405's `Allow` lists them), the roles of a chat, and which prompts are missing."""

import jsonschema
import pytest
from fastapi.testclient import TestClient

from blocktune.runtime.config import EngineConfig
from blocktune.runtime.engine import Engine
from blocktune.runtime.engine_loop import EngineLoop
from blocktune.runtime.loading import load_weights
from blocktune.runtime.tokenizer import Tokenizer
from blocktune.tuner.serving.worker_app import create_worker_app

USER = {"role": "user", "content": "Where is my parcel?"}


@pytest.fixture(scope="module")
def app():
    config = EngineConfig(block_size=8, num_blocks=64, max_model_len=256)
    loop = EngineLoop(Engine(load_weights("tiny-random", seed=0), config))
    loop.start()
    yield create_worker_app(loop, model_name="tiny-random", tokenizer=Tokenizer.byte_level())
    loop.stop()


@pytest.fixture(scope="module")
def client(app):
    with TestClient(app, base_url="http://127.0.0.1") as client:
        yield client


def _allowed(answer) -> set[str]:
    return {method.strip() for method in answer.headers["allow"].split(",")}


@pytest.mark.parametrize("path", ["/health", "/metrics"])
def test_health_and_metrics_serve_get_and_head_as_documented(app, client, path):
    assert client.get(path).status_code == 200
    assert client.head(path).status_code == 200
    refused = client.options(path)
    assert refused.status_code == 405
    assert _allowed(refused) == {"GET", "HEAD"}
    assert set(app.openapi()["paths"][path]) == {"get", "head"}


def test_a_405_lists_the_methods_of_its_path(client):
    refused = client.get("/v1/completions")
    assert refused.status_code == 405 and _allowed(refused) == {"POST"}


def test_a_tool_message_is_rendered_through_the_chat_template(client):
    tool = {"role": "tool", "content": '{"status": "shipped"}', "tool_call_id": "call-1"}
    messages = [USER, {"role": "assistant", "content": "Let me look."}, tool]
    body = {"messages": messages, "max_tokens": 2, "temperature": 0}
    answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    prompt = Tokenizer.byte_level().apply_chat_template(
        [{"role": m["role"], "content": m["content"]} for m in messages]
    )
    assert answer.json()["usage"]["prompt_tokens"] == len(prompt)


def _valid(openapi: dict, path: str, body: dict) -> bool:
    schema = openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]
    try:
        jsonschema.validate(body, {**schema["schema"], "components": openapi["components"]})
    except jsonschema.ValidationError:
        return False
    return True


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": None}),
        ("/v1/completions", {"prompt": None, "prompt_ids": [1]}),
        ("/v1/completions", {"prompt": "hi", "prompt_ids": None}),
        ("/v1/completions", {"prompt": None, "prompt_ids": None}),
        ("/v1/completions", {"prompt": []}),
        ("/v1/completions", {"prompt": "hi", "prompt_ids": [1]}),
        ("/v1/chat/completions", {"messages": [USER], "max_tokens": None}),
        (
            "/v1/chat/completions",
            {"messages": [USER], "max_tokens": None, "max_completion_tokens": 2},
        ),
        ("/v1/chat/completions", {"messages": [USER], "max_tokens": 2, "max_completion_tokens": 2}),
    ],
)
def test_the_schema_takes_a_body_exactly_when_the_worker_does(app, client, path, body):
    """null is any optional field's default, in the schema as in the worker."""
    answer = client.post(path, json={**body, "temperature": 0})
    assert answer.status_code in (200, 422), answer.text
    assert _valid(app.openapi(), path, body) is (answer.status_code == 200)
