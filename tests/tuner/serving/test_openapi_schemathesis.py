"""Schemathesis against both services over loopback: no 5xx, and every answer (status code,
content type, body, headers) as their OpenAPI documents say.

A bounded run: `EXAMPLES` generated requests per operation and mode (schema-valid ones, and
for operations that take a body, schema-violating ones). Not checked: that every schema-valid
request is accepted, since JSON Schema cannot say what the strict models refuse on purpose (an
integer written `3.0` is a JSON Schema integer; a token id outside the vocabulary, a prompt
longer than max_model_len), nor that every invalid one is refused with a code schemathesis
expects (413 for too many observations is a refusal too).
"""

from pathlib import Path

import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from blocktune.runtime.config import EngineConfig
from blocktune.runtime.engine import Engine
from blocktune.runtime.engine_loop import EngineLoop
from blocktune.runtime.loading import load_weights
from blocktune.runtime.tokenizer import Tokenizer
from blocktune.tuner.config.policy import load_policy
from blocktune.tuner.serving.sidecar_app import create_sidecar_app
from blocktune.tuner.serving.worker_app import create_worker_app
from blocktune.tuner.sidecar.assembly import build_sidecar

POLICY = load_policy(Path(__file__).resolve().parents[3] / "policies" / "default.yaml")
EXAMPLES = 100  # per operation and mode: about a minute for both services on 2 cores

pytestmark = pytest.mark.slow
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]


def operations(url: str) -> list[tuple[str, object, GenerationMode]]:
    """(label, operation, mode) of every operation of the service at `url`: schema-valid
    requests for all, schema-violating ones where there is a body to violate."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    found = []
    for result in schema.get_all_operations():
        operation = result.ok()
        found.append((operation.label, operation, GenerationMode.POSITIVE))
        if len(operation.body):
            found.append((operation.label, operation, GenerationMode.NEGATIVE))
    return found


def conforms(url: str, operation, mode: GenerationMode) -> None:
    """Run `EXAMPLES` requests of `mode` against `operation`; raise on the first failure."""

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,  # the same requests on every run: CI fails only for a change
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case) -> None:
        case.call_and_validate(base_url=url, checks=CHECKS, timeout=60)

    check()


def test_the_sidecar_answers_as_documented(live_server):
    with live_server(create_sidecar_app(build_sidecar(POLICY))) as url:
        found = operations(url)
        for _, operation, mode in found:
            conforms(url, operation, mode)
    assert {"POST /v1/observations", "GET /metrics"} <= {label for label, *_ in found}


def test_the_worker_answers_as_documented(live_server):
    # A short context keeps every generated completion quick.
    config = EngineConfig(block_size=8, num_blocks=64, max_model_len=64)
    loop = EngineLoop(Engine(load_weights("tiny-random"), config))
    loop.start()
    app = create_worker_app(loop, model_name="tiny-random", tokenizer=Tokenizer.byte_level())
    try:
        with live_server(app) as url:
            found = operations(url)
            for _, operation, mode in found:
                conforms(url, operation, mode)
    finally:
        loop.stop()
    labels = {label for label, *_ in found}
    assert {"POST /v1/chat/completions", "POST /admin/block-size", "GET /metrics"} <= labels


@pytest.fixture(scope="module")
def worker_openapi() -> dict:
    config = EngineConfig(block_size=8, num_blocks=64, candidate_block_sizes=(8, 16, 32))
    loop = EngineLoop(Engine(load_weights("tiny-random"), config))  # never started: no steps
    return create_worker_app(loop, model_name="tiny-random", tokenizer=None).openapi()


def body_is_valid(openapi: dict, path: str, body: dict) -> bool:
    """Whether `body` satisfies the request schema of `POST path` in `openapi`."""
    schema = openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]
    document = {**schema["schema"], "components": openapi["components"]}
    try:
        jsonschema.validate(body, document)
    except jsonschema.ValidationError:
        return False
    return True


@pytest.mark.parametrize(
    ("path", "body", "valid"),
    [
        ("/admin/block-size", {"block_size": 16}, True),
        ("/admin/block-size", {"block_size": 0}, False),
        ("/admin/block-size", {"block_size": 64}, False),  # a power of two, not a candidate
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, True),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
                "max_completion_tokens": 4,
            },
            False,
        ),
        ("/v1/completions", {"prompt": "hi"}, True),
        ("/v1/completions", {}, False),
        ("/v1/completions", {"prompt": "hi", "prompt_ids": [1]}, False),
    ],
)
def test_the_worker_schema_refuses_what_the_worker_refuses(worker_openapi, path, body, valid):
    assert body_is_valid(worker_openapi, path, body) is valid


def test_the_chat_schema_documents_the_default_completion_length(worker_openapi):
    fields = worker_openapi["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    for name in ("max_tokens", "max_completion_tokens"):
        assert "default: the room left in the context" in fields[name]["description"]
