"""The requests guidellm and aiperf send, replayed against the worker: captured once from the
real tools (`bench/clients.py --capture tests/data/clients`), so CI catches a regression
without installing them."""

import json
from pathlib import Path

import httpx
import pytest

from blocktune.runtime.config import EngineConfig
from blocktune.runtime.engine import Engine
from blocktune.runtime.engine_loop import EngineLoop
from blocktune.runtime.loading import load_pretrained
from blocktune.runtime.tokenizer import Tokenizer
from blocktune.tuner.serving.worker_app import create_worker_app

CAPTURED = Path(__file__).resolve().parents[2] / "data" / "clients"
TOOLS = sorted(path.stem for path in CAPTURED.glob("*.json"))
SERVED_AS = "smollm2"  # the name the tools were pointed at


@pytest.fixture(scope="module")
def model():
    return load_pretrained("tiny-random").model


@pytest.fixture
def worker(model, live_server):
    loop = EngineLoop(Engine(model, EngineConfig(block_size=8, num_blocks=256)))
    loop.start()
    app = create_worker_app(loop, model_name=SERVED_AS, tokenizer=Tokenizer.byte_level())
    with live_server(app) as url:
        yield url
    loop.stop()


def events(response: httpx.Response) -> list[dict]:
    """The JSON chunks of a server-sent event stream, checking it ends with [DONE]."""
    data = [
        line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")
    ]
    assert data[-1] == "[DONE]"
    return [json.loads(item) for item in data[:-1]]


def test_both_tools_were_captured():
    assert TOOLS == ["aiperf", "guidellm"]


@pytest.mark.parametrize("tool", TOOLS)
def test_each_captured_request_is_served(worker, tool):
    requests = json.loads((CAPTURED / f"{tool}.json").read_text())
    assert any(r["method"] == "POST" for r in requests)
    for request in requests:
        response = httpx.request(
            request["method"], worker + request["path"], json=request["body"], timeout=120
        )
        assert response.status_code == 200, (tool, request["path"], response.text)
        body = request["body"]
        if request["method"] != "POST":
            continue
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        assert body.get("stream"), "both tools stream by default"
        chunks = events(response)
        assert all("error" not in chunk for chunk in chunks), chunks
        text = [c for c in chunks if c["choices"]]
        usage = chunks[-1]["usage"]
        assert chunks[-1]["choices"] == [] and usage["completion_tokens"] >= 1
        if body.get("ignore_eos"):
            assert usage["completion_tokens"] == limit
        if body["stream_options"].get("continuous_usage_stats"):
            assert all(c["usage"]["prompt_tokens"] == usage["prompt_tokens"] for c in text)
        assert text[-1]["choices"][0]["finish_reason"] in ("stop", "length")
