"""What OpenAI's and vLLM's servers accept, the worker accepts: nulls, ignored platform fields,
penalties, logit_bias, vLLM's sampling extras, the developer role, a message name; what it
does not serve is a 400 that says so. Through the official `openai` client where it can
send the field, else as raw JSON."""

import httpx
import pytest
import torch

from blocktune.runtime.config import EngineConfig
from blocktune.runtime.engine import Engine
from blocktune.runtime.engine_loop import EngineLoop
from blocktune.runtime.sampling import SamplingParams
from blocktune.tuner.serving.worker_app import create_worker_app

openai = pytest.importorskip("openai")

MODEL = "tiny-random"
CONFIG = EngineConfig(block_size=8, num_blocks=256)
USER = [{"role": "user", "content": "Where is my parcel?"}]


@pytest.fixture
def worker(loaded, serve_worker):
    with serve_worker(loaded, CONFIG, MODEL) as url:
        yield url


def greedy(loaded, prompt: list[int], **params) -> str:
    (output,) = Engine(loaded.model, CONFIG).generate([prompt], SamplingParams(**params))
    return loaded.tokenizer.decode(output.token_ids)


def test_health_answers_as_vllms_does(worker, loaded, live_server):
    response = httpx.get(f"{worker}/health")
    assert response.status_code == 200 and response.content == b""
    stopped = EngineLoop(Engine(loaded.model, CONFIG))  # never started: the engine is down
    with live_server(create_worker_app(stopped, model_name=MODEL, tokenizer=None)) as url:
        down = httpx.get(f"{url}/health")
    assert down.status_code == 503 and down.json()["error"]["type"] == "server_error"


def test_platform_fields_and_zero_penalties_change_nothing(client, loaded):
    plain = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, temperature=0)
    extras = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=6,
        temperature=0,
        presence_penalty=0,
        frequency_penalty=0,
        user="customer-7",
        store=False,
        parallel_tool_calls=False,
        metadata={"team": "support"},
        response_format={"type": "text"},
        logit_bias={},
        tool_choice="none",
    )
    assert extras.choices[0].message.content == plain.choices[0].message.content


def test_null_means_the_default_for_every_optional_field(worker):
    body = {
        "messages": USER,
        "model": None,
        "temperature": None,
        "top_p": None,
        "n": None,
        "max_tokens": None,
        "max_completion_tokens": 5,
        "stop": None,
        "seed": None,
        "logprobs": None,
        "top_logprobs": None,
        "presence_penalty": None,
        "frequency_penalty": None,
        "logit_bias": None,
        "stream": None,
        "stream_options": None,
        "user": None,
        "response_format": None,
        "tools": None,
        "tool_choice": None,
        "top_k": None,
        "min_p": None,
        "ignore_eos": None,
        "min_tokens": None,
    }
    response = httpx.post(f"{worker}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 5
    completion = {"prompt": "Hi", "max_tokens": None, "echo": None, "logprobs": None, "n": None}
    answer = httpx.post(f"{worker}/v1/completions", json=completion, timeout=60).json()
    assert answer["usage"]["completion_tokens"] == 16  # OpenAI's default max_tokens


def test_developer_is_system_and_a_name_is_accepted(client, loaded):
    developer = [{"role": "developer", "content": "Be brief."}, {**USER[0], "name": "ana"}]
    system = [{"role": "system", "content": "Be brief."}, USER[0]]
    prompt = loaded.tokenizer.apply_chat_template(system)
    response = client.chat.completions.create(
        model=MODEL, messages=developer, max_tokens=6, temperature=0
    )
    assert response.choices[0].message.content == greedy(loaded, prompt, max_tokens=6)
    assert response.usage.prompt_tokens == len(prompt)


def test_penalties_bias_and_vllms_extras_reach_the_sampler(client, loaded):
    prompt = loaded.tokenizer.encode("Tell me")
    token = loaded.tokenizer.encode("x")[0]
    biased = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logit_bias={str(token): 100}
    )
    assert biased.choices[0].text == "x" * 4
    extras = {"top_k": 3, "min_p": 0.1, "repetition_penalty": 1.3, "min_tokens": 2}
    params = dict(max_tokens=6, temperature=0, presence_penalty=0.5, frequency_penalty=0.7)
    served = client.completions.create(
        model=MODEL, prompt=prompt, **params, extra_body={**extras, "ignore_eos": True}
    )
    expected = greedy(loaded, prompt, **params, **extras, ignore_eos=True)
    assert served.choices[0].text == expected
    sampled = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, seed=3)
    top1 = client.completions.create(**sampled, extra_body={"top_k": 1})
    assert top1.choices[0].text == greedy(loaded, prompt, max_tokens=8)  # top_k 1 is greedy


def test_continuous_usage_stats_puts_the_counts_on_every_chunk(client):
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=[1, 2, 3],
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        )
    )
    text_chunks = [c for c in chunks if c.choices]
    assert all(c.usage is not None and c.usage.prompt_tokens == 3 for c in text_chunks)
    counts = [c.usage.completion_tokens for c in text_chunks]
    assert counts == sorted(counts) and counts[-1] == 5
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 8


@pytest.mark.parametrize(
    ("call", "param", "says"),
    [
        (
            {"tools": [{"type": "function", "function": {"name": "track", "parameters": {}}}]},
            "tools",
            "not supported",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"response_format": {"type": "json_object"}}, "response_format", '{"type": "text"}'),
    ],
)
def test_what_is_not_served_is_a_400_that_says_so(client, call, param, says):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(**{"model": MODEL, "messages": USER, **call})
    assert error.value.body["param"] == param
    assert says in error.value.message


def test_best_of_equal_to_n_is_served_and_above_is_a_400(client):
    served = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, n=2, best_of=2)
    assert len(served.choices) == 2
    with pytest.raises(openai.BadRequestError, match="best_of 3 with n 1") as error:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, best_of=3)
    assert error.value.body["param"] == "best_of"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"logit_bias": {"hello": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
    ],
)
def test_out_of_range_sampling_fields_are_named(worker, body, param):
    response = httpx.post(f"{worker}/v1/completions", json={"prompt": "x", **body})
    assert response.status_code == 422
    assert response.json()["error"]["param"].startswith(param)


def test_a_bias_outside_the_vocabulary_is_a_400(worker, loaded):
    vocab = loaded.model.config.vocab_size
    body = {"prompt": "x", "logit_bias": {str(vocab): 5}}
    response = httpx.post(f"{worker}/v1/completions", json=body)
    assert response.status_code == 400
    assert "outside the vocabulary" in response.json()["error"]["message"]


def test_echo_with_logprobs_scores_the_prompt_too(client, loaded):
    prompt = "Once upon"
    ids = loaded.tokenizer.encode(prompt)
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=2)
    scored = client.completions.create(**kwargs, echo=True)
    choice = scored.choices[0]
    generated = client.completions.create(**kwargs).choices[0]
    assert choice.text == prompt + generated.text
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(ids) + 3
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[len(ids) :] == generated.logprobs.token_logprobs
    dense = loaded.model.forward_dense(torch.tensor(ids)).log_softmax(-1)
    for position in range(1, len(ids)):
        expected = float(dense[position - 1, ids[position]])
        assert logprobs.token_logprobs[position] == pytest.approx(expected, abs=1e-4)
        assert len(logprobs.top_logprobs[position]) <= 2
    assert logprobs.text_offset[0] == 0
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    streamed = client.completions.create(**kwargs, echo=True, stream=True)
    tokens = [t for chunk in streamed for t in chunk.choices[0].logprobs.tokens]
    assert tokens == logprobs.tokens
