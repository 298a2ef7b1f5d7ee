"""One request never fails the others of its step, over HTTP: a request that leaves no token
to sample is served, one whose sampling still raises ends alone (its stream with an error
event, its answer a 500), and the streams beside it finish as they would alone."""

import concurrent.futures
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from blocktune.runtime import runner as runner_module
from blocktune.runtime.config import EngineConfig
from blocktune.runtime.engine import Engine
from blocktune.runtime.engine_loop import EngineLoop
from blocktune.runtime.loading import load_weights
from blocktune.runtime.sampling import SamplingParams
from blocktune.runtime.tokenizer import Tokenizer
from blocktune.tuner.serving.worker_app import create_worker_app

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [1, 2, 3, 4, 5, 6], [40, 41], [7] * 9]
MAX_TOKENS = 24
GATHER_S = 0.3  # every request of a test reaches the engine's first step


@pytest.fixture(scope="module")
def model():
    return load_weights("tiny-random", seed=0)


def _engine(model) -> Engine:
    return Engine(model, EngineConfig(block_size=8, num_blocks=256))


@pytest.fixture
def worker(model, live_server):
    loop = EngineLoop(_engine(model), gather_s=GATHER_S)
    loop.start()
    app = create_worker_app(loop, model_name="tiny-random", tokenizer=Tokenizer.byte_level())
    with live_server(app) as url:
        yield url, loop
    loop.stop()


def _alone(model) -> list[str]:
    """Each prompt's greedy text, served alone."""
    outputs = _engine(model).generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
    return [Tokenizer.byte_level().decode(o.token_ids) for o in outputs]


def _stream(url: str, body: dict) -> list[dict]:
    """The stream's events (each chunk or error object as JSON), up to [DONE]."""
    events = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line.removeprefix("data: ")))
    return events


def _beside(url: str, odd: dict) -> tuple[list[list[dict]], list[dict], httpx.Response]:
    """The greedy streams of `PROMPTS`, and `odd` streamed and answered whole, all at once."""
    greedy = [
        {"prompt_ids": p, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
        for p in PROMPTS
    ]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS) + 2) as pool:
        streams = [pool.submit(_stream, url, body) for body in greedy]
        odd_stream = pool.submit(_stream, url, {**odd, "stream": True})
        whole = pool.submit(httpx.post, f"{url}/v1/completions", json=odd, timeout=60)
        return [s.result() for s in streams], odd_stream.result(), whole.result()


def _finished_alone(model, streams: list[list[dict]]) -> None:
    """Each greedy stream ended with "length" and the text it has alone."""
    texts = ["".join(e["choices"][0]["text"] for e in events) for events in streams]
    assert texts == _alone(model)
    assert [events[-1]["choices"][0]["finish_reason"] for events in streams] == ["length"] * 5


def test_every_token_a_stop_token_with_min_tokens_fails_no_stream(model, worker):
    """The issue's reproducer: 503 and every stream of the step ended with an error."""
    url, loop = worker
    odd = {"prompt": "hi", "max_tokens": 8, "stop_token_ids": list(range(256)), "min_tokens": 5}
    streams, odd_events, whole = _beside(url, odd)
    _finished_alone(model, streams)
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    assert len(choice["token_ids"]) == 5 and choice["finish_reason"] == "stop"
    assert odd_events[-1]["choices"][0]["finish_reason"] == "stop"
    assert loop.state()["failed_steps"] == 0


def test_a_request_whose_sampling_raises_ends_alone(model, worker, monkeypatch):
    url, loop = worker
    real = runner_module.next_token_distribution

    def fails_for_one(logits, params, **context):
        if params.seed == 77 and len(context["output"]) == 2:  # after its first tokens
            raise RuntimeError("injected sampling fault")
        return real(logits, params, **context)

    monkeypatch.setattr(runner_module, "next_token_distribution", fails_for_one)
    odd = {"prompt": "hi", "max_tokens": 8, "seed": 77}
    streams, odd_events, whole = _beside(url, odd)
    _finished_alone(model, streams)
    assert whole.status_code == 500
    error = whole.json()["error"]
    assert error["type"] == "server_error" and "injected sampling fault" in error["message"]
    assert odd_events[-1] == {"error": error} and "choices" in odd_events[0]
    assert loop.state()["failed_steps"] == 0 and loop.state()["blocks_used"] == 0


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stop_token_ids": list(range(256)) * 2}, "stop_token_ids"),
        ({"repetition_penalty": 1e308}, "repetition_penalty"),
    ],
)
def test_what_can_be_refused_is_refused_naming_the_field(worker, path, extra, param):
    url, _ = worker
    messages = [{"role": "user", "content": "hi"}]
    prompt = {"prompt": "hi"} if path == "completions" else {"messages": messages}
    answer = httpx.post(f"{url}/v1/{path}", json={**prompt, "max_tokens": 8, **extra}, timeout=30)
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["param"] == param


def _successes(url: str) -> dict[str, float]:
    """vllm:request_success_total by finished_reason."""
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
    (success,) = [f for f in families if f.name == "vllm:request_success"]
    return {s.labels["finished_reason"]: s.value for s in success.samples}


def test_every_request_of_a_failed_step_counts_once_as_an_error(worker, monkeypatch):
    url, loop = worker
    forward_step = loop.engine.model.forward_step
    failed = []

    def fails_once_with_all_five(*args, **kwargs):
        if not failed and kwargs["logit_rows"].numel() == 5:
            failed.append(True)
            raise RuntimeError("injected device fault")
        return forward_step(*args, **kwargs)

    monkeypatch.setattr(loop.engine.model, "forward_step", fails_once_with_all_five)
    # Long enough to run side by side however late one arrives; all end at the failed step.
    bodies = [{"prompt_ids": p, "max_tokens": 1000} for p in PROMPTS[:3]]
    two = {"prompt_ids": PROMPTS[3], "max_tokens": 1000, "n": 2}  # two engine requests
    bodies.append(two)
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        posts = [
            pool.submit(httpx.post, f"{url}/v1/completions", json=b, timeout=60) for b in bodies
        ]
        answers = [p.result() for p in posts]
    assert [a.status_code for a in answers] == [503] * 4
    assert loop.state()["failed_steps"] == 1
    assert _successes(url) == {"stop": 0, "length": 0, "abort": 0, "error": 5}
