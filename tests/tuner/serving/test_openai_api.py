"""The worker's OpenAI-compatible API through the official `openai` client (tiny-random model,
byte-level text), checked against the engine serving the same prompts directly."""

import httpx
import pytest
import torch

from blocktune.runtime.config import EngineConfig
from blocktune.runtime.engine import Engine
from blocktune.runtime.sampling import SamplingParams

openai = pytest.importorskip("openai")

MODEL = "tiny-random"
CONFIG = EngineConfig(block_size=8, num_blocks=256)


@pytest.fixture
def worker(loaded, serve_worker):
    with serve_worker(loaded, CONFIG, MODEL) as url:
        yield url


def greedy(loaded, prompts, max_tokens, **params):
    """The engine's own greedy outputs for token-id prompts."""
    engine = Engine(loaded.model, CONFIG)
    return engine.generate(prompts, SamplingParams(max_tokens=max_tokens, **params))


def test_models_list_and_retrieve(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).owned_by == "blocktune"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_completions_of_every_prompt_form_match_the_engine(client, loaded):
    texts = ["Hello there", "The weather today"]
    ids = [loaded.tokenizer.encode(t) for t in texts]
    expected = greedy(loaded, ids, 6)
    for prompt in (texts, ids):
        response = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=6, temperature=0
        )
        assert response.object == "text_completion" and response.model == MODEL
        assert [c.index for c in response.choices] == [0, 1]
        for choice, output in zip(response.choices, expected, strict=True):
            assert choice.text == loaded.tokenizer.decode(output.token_ids)
            assert choice.finish_reason == "length"
        assert response.usage.prompt_tokens == sum(map(len, ids))
        assert response.usage.completion_tokens == 12 and response.usage.total_tokens == 12 + sum(
            map(len, ids)
        )
    single = client.completions.create(model=MODEL, prompt=ids[1], max_tokens=6, temperature=0)
    assert single.choices[0].text == loaded.tokenizer.decode(expected[1].token_ids)


def test_echo_n_seed_and_logprobs(client, loaded):
    prompt = "Once upon"
    echoed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True
    )
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    sampled = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, n=3, seed=11)
    first, again = client.completions.create(**sampled), client.completions.create(**sampled)
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices]  # seeded: reproducible
    assert len(set(texts)) > 1  # choice j uses seed + j
    scored = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=2
    )
    logprobs = scored.choices[0].logprobs
    ids = loaded.tokenizer.encode(prompt)
    tokens = greedy(loaded, [ids], 3)[0].token_ids
    dense = loaded.model.forward_dense(torch.tensor(ids + tokens)).log_softmax(-1)
    for step, token in enumerate(tokens):
        row = dense[len(ids) - 1 + step]
        assert logprobs.token_logprobs[step] == pytest.approx(float(row[token]), abs=1e-4)
        assert max(logprobs.top_logprobs[step].values()) == pytest.approx(
            float(row.max()), abs=1e-4
        )
    assert logprobs.tokens == [loaded.tokenizer.decode([t]) for t in tokens]
    assert logprobs.text_offset[0] == 0


def test_stop_strings_and_stop_token_ids_end_a_choice(client, loaded):
    prompt = "Tell me"
    tokens = greedy(loaded, [loaded.tokenizer.encode(prompt)], 24)[0].token_ids
    text = loaded.tokenizer.decode(tokens)
    # A printable character some way into the greedy text, as the stop string.
    at = next(i for i, c in enumerate(text) if i >= 3 and c.isascii() and c.isprintable())
    stop = text[at]
    common = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    response = client.completions.create(**common, stop=[stop])
    assert response.choices[0].text == text[: text.index(stop)]
    assert response.choices[0].finish_reason == "stop"
    streamed = client.completions.create(**common, stop=stop, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == response.choices[0].text
    by_id = client.completions.create(**common, extra_body={"stop_token_ids": [tokens[5]]})
    assert by_id.choices[0].finish_reason == "stop"
    assert by_id.choices[0].text == loaded.tokenizer.decode(tokens[: tokens.index(tokens[5]) + 1])


def test_chat_completion_and_its_stream_agree(client, loaded):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Where is my parcel?"},
    ]
    prompt = loaded.tokenizer.apply_chat_template(messages)
    expected = loaded.tokenizer.decode(greedy(loaded, [prompt], 10)[0].token_ids)
    common = dict(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0)
    response = client.chat.completions.create(**common)
    assert response.object == "chat.completion"
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected
    assert response.usage.prompt_tokens == len(prompt)
    chunks = list(
        client.chat.completions.create(
            **common, stream=True, stream_options={"include_usage": True}
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_chat_logprobs_and_content_parts(client, loaded):
    parts = [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": parts}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi there"}], max_tokens=3, temperature=0
    )
    assert response.choices[0].message.content == plain.choices[0].message.content
    content = response.choices[0].logprobs.content
    assert len(content) == 3 and all(len(entry.top_logprobs) == 2 for entry in content)
    assert all(
        entry.logprob <= 0 and entry.top_logprobs[0].logprob >= entry.logprob for entry in content
    )


def test_a_chat_without_max_tokens_may_fill_the_room_left(loaded, serve_worker):
    config = EngineConfig(block_size=8, num_blocks=64, max_model_len=48)
    with serve_worker(loaded, config, MODEL) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "hi"}]
        response = client.chat.completions.create(model=MODEL, messages=messages, temperature=0)
    prompt = loaded.tokenizer.apply_chat_template(messages)
    assert response.usage.completion_tokens == 48 - len(prompt)
    assert response.choices[0].finish_reason == "length"


def test_refusals_are_openai_errors(client, worker):
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="other", prompt="x")
    assert error.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL, prompt="x", max_tokens=5000)
    assert "max_tokens 5000 is more than the 2048 tokens left" in error.value.message
    assert error.value.body["param"] == "max_tokens"
    with pytest.raises(openai.UnprocessableEntityError) as error:
        client.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "x"}])
    assert error.value.body["param"].startswith("messages.0.role")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt_ids": ["1"]}, "prompt_ids.0"),
        ({"prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"prompt": "x", "max_tokens": "16"}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 3.0}, "max_tokens"),
        ({"prompt": "x", "n": 17}, "n"),
        ({"prompt": ["x"] * 65}, "prompt"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "body"),
    ],
)
def test_no_coercion(worker, body, param):
    response = httpx.post(f"{worker}/v1/completions", json=body)
    assert response.status_code == 422
    assert response.json()["error"]["param"].startswith(param)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", b'{"prompt": "x", "temperature": NaN}'),
        ("/v1/completions", b'{"prompt": "x", "top_p": Infinity}'),
        ("/v1/completions", b'{"prompt": [1, NaN]}'),
        ("/v1/completions", b'{"prompt": "x", "unknown": NaN}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": NaN}]}'),
        ("/admin/block-size", b'{"block_size": NaN}'),
    ],
)
def test_nan_anywhere_is_a_4xx_in_openais_shape(worker, path, body):
    """NaN and Infinity are not standard JSON: the shared guard refuses the body with 400
    (as OpenAI's API answers a body it cannot parse), never a 500."""
    response = httpx.post(
        f"{worker}{path}", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert "not standard JSON" in response.json()["error"]["message"]
    assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", b'{"prompt": "x\\ud800y"}'),
        ("/v1/completions", b'{"prompt": ["ok", "\\udfff"]}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud83d"}]}'),
        ("/v1/completions", b'{"prompt": "x", "model": "\\ud800"}'),
    ],
)
def test_a_lone_surrogate_is_refused_not_a_server_error(worker, path, body):
    response = httpx.post(
        f"{worker}{path}", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code in (400, 404)
    assert response.json()["error"]["message"]
