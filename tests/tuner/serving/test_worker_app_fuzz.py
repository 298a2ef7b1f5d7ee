"""Fuzzing the worker's endpoints on a real server: no input makes it answer 5xx.

Bodies come in three kinds: every field valid (so generation, streaming, stop
strings and logprobs run), every field near valid or not (NaN, huge integers,
lone surrogates, wrong types), and arbitrary JSON or bytes.
"""

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blocktune.runtime.config import EngineConfig
from blocktune.runtime.engine import Engine
from blocktune.runtime.engine_loop import EngineLoop
from blocktune.runtime.loading import load_pretrained
from blocktune.tuner.serving.worker_app import create_worker_app

pytestmark = pytest.mark.slow

TOKEN = "fuzz-token"
PATHS = ("/v1/completions", "/v1/chat/completions", "/admin/block-size")

texts = st.text(max_size=12) | st.sampled_from(["\ud800", "a\udfffb", "tiny-random", "", "\x00"])
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.integers(min_value=-2, max_value=300)
    | st.floats(allow_nan=True, allow_infinity=True)
    | texts
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=20,
)
ids = st.lists(st.integers(0, 255), min_size=1, max_size=12)
words = st.text(min_size=1, max_size=20)
valid = {
    "prompt": words | ids | st.lists(words, min_size=1, max_size=3),
    "prompt_ids": ids,
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant"]), "content": words}
        ),
        min_size=1,
        max_size=3,
    ),
    "model": st.just("tiny-random"),
    "max_tokens": st.integers(1, 8),
    "max_completion_tokens": st.integers(1, 8),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "seed": st.integers(0, 2**40),
    "n": st.integers(1, 3),
    "stop": words | st.lists(words, max_size=4),
    "stop_token_ids": ids,
    "stream": st.booleans(),
    "echo": st.booleans(),
    "block_size": st.sampled_from([8, 16, 32, 64, 128]),
}
COMPLETION = ["model", "max_tokens", "temperature", "top_p", "seed", "n", "stop",
              "stop_token_ids", "stream", "echo"]  # fmt: skip
CHAT = ["model", "max_completion_tokens", "temperature", "top_p", "seed", "n", "stop", "stream"]


def bodies(required: list[str], optional: list[str], extra: dict) -> st.SearchStrategy:
    """Valid bodies, and bodies whose every field may be anything."""
    good = st.fixed_dictionaries(
        {k: valid[k] for k in required}, optional={k: valid[k] for k in optional}
    )
    anything = {k: valid.get(k, scalars) | json_values for k in [*required, *optional, *extra]}
    mixed = st.fixed_dictionaries(
        {k: anything[k] for k in required},
        optional={k: v for k, v in anything.items() if k not in required},
    )
    return good | mixed | json_values


def encoded(values: st.SearchStrategy) -> st.SearchStrategy:
    return values.map(lambda v: json.dumps(v).encode())


requests = (
    st.tuples(
        st.just(PATHS[0]),
        encoded(bodies(["prompt"], COMPLETION, {"prompt_ids", "logprobs", "stream_options"})),
    )
    | st.tuples(
        st.just(PATHS[1]),
        encoded(bodies(["messages"], CHAT, {"max_tokens", "logprobs", "top_logprobs", "x"})),
    )
    | st.tuples(st.just(PATHS[2]), encoded(bodies(["block_size"], [], {"extra"})))
    | st.tuples(st.sampled_from(PATHS), st.binary(max_size=64) | st.just(b"[" * 100_000))
)


def test_no_input_gets_a_server_error(live_server):
    loaded = load_pretrained("tiny-random")
    config = EngineConfig(block_size=8, num_blocks=64, max_model_len=64, max_num_seqs=16)
    loop = EngineLoop(Engine(loaded.model, config))
    loop.start()
    app = create_worker_app(loop, model_name="tiny-random", tokenizer=loaded.tokenizer, token=TOKEN)
    headers = {"content-type": "application/json", "authorization": f"Bearer {TOKEN}"}
    statuses = []
    with live_server(app) as url, httpx.Client(base_url=url, timeout=60) as client:

        @settings(
            max_examples=300,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(request=requests)
        def post(request: tuple[str, bytes]) -> None:
            path, body = request
            response = client.post(path, content=body, headers=headers)
            assert response.status_code < 500, (path, body[:200], response.text[:300])
            statuses.append(response.status_code)
            if response.status_code >= 400:
                assert response.json()["error"]["message"]

        post()
        assert client.get("/healthz").status_code == 200
    loop.stop()
    assert statuses.count(200) >= 30  # valid requests were served, not only refused
    assert loop.state()["failed_steps"] == 0 and loop.state()["blocks_used"] == 0
    loop.check()
