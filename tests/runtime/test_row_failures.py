"""One request's sampling never fails another: the sampler is total (a row with no token
left falls back to the model's own likeliest token), and a row that still fails ends only its
own request, with finish_reason "error", while the others of its step go on unchanged."""

import pytest
import torch

from blocktune.runtime import runner as runner_module
from blocktune.runtime.config import EngineConfig
from blocktune.runtime.engine import Engine
from blocktune.runtime.loading import load_weights
from blocktune.runtime.requests import FinishedRequest
from blocktune.runtime.sampling import SamplingParams, next_token_distribution

VOCAB = 12
GREEDY = SamplingParams(max_tokens=10)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [1, 2, 3, 4, 5, 6]]


@pytest.fixture(scope="module")
def model():
    return load_weights("tiny-random", seed=0)


def _engine(model) -> Engine:
    return Engine(model, EngineConfig(block_size=8, num_blocks=64))


def _alone(model) -> list[list[int]]:
    return [o.token_ids for o in _engine(model).generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_token_a_stop_token_before_min_tokens_falls_back_to_the_raw_argmax(temperature):
    logits = torch.tensor([0.5, 3.0, -1.0] + [0.0] * (VOCAB - 3))
    params = SamplingParams(
        temperature=temperature, stop_token_ids=tuple(range(VOCAB)), min_tokens=5
    )
    probs = next_token_distribution(logits, params, prompt=[4], output=[], eos_token_ids=())
    assert probs.tolist() == [0.0, 1.0] + [0.0] * (VOCAB - 2)


def test_a_penalty_that_overflows_every_logit_falls_back_to_the_raw_argmax():
    """repetition_penalty 1e308 times a logit of about -100 is -inf for every token seen."""
    logits = torch.tensor([0.5, -2.0, 3.0] + [0.0] * (VOCAB - 3))
    params = SamplingParams(
        temperature=1.0,
        repetition_penalty=1e308,
        logit_bias={token: -100.0 for token in range(VOCAB)},
    )
    prompt = list(range(VOCAB))  # every token seen
    probs = next_token_distribution(logits, params, prompt=prompt, output=[], eos_token_ids=())
    assert probs.tolist() == [0.0, 0.0, 1.0] + [0.0] * (VOCAB - 3)


def test_a_nan_logit_counts_as_minus_infinity():
    logits = torch.tensor([float("nan"), -torch.inf, 1.0] + [0.0] * (VOCAB - 3))
    params = SamplingParams(temperature=1.0)
    probs = next_token_distribution(logits, params, prompt=[4], output=[], eos_token_ids=())
    assert probs[0] == 0 and probs[1] == 0 and probs.sum() == pytest.approx(1.0)


def test_a_row_with_no_token_left_does_not_fail_its_step(model):
    """The issue's reproducer: all of the vocabulary as stop tokens with min_tokens, sampled,
    beside greedy requests in the same steps."""
    vocab = model.config.vocab_size
    bad = SamplingParams(
        max_tokens=8, temperature=1.0, stop_token_ids=tuple(range(vocab)), min_tokens=5
    )
    outputs = _engine(model).generate([*PROMPTS, [1, 2]], [GREEDY] * len(PROMPTS) + [bad])
    assert [o.token_ids for o in outputs[:-1]] == _alone(model)
    # min_tokens are generated, then the first token may stop, and every token is a stop token.
    assert len(outputs[-1].token_ids) == 5 and outputs[-1].finish_reason == "stop"


def test_a_row_whose_sampling_raises_ends_alone_and_the_others_are_unchanged(model, monkeypatch):
    engine = _engine(model)
    finished: list[FinishedRequest] = []
    engine.add_listener(finished.append)
    sampled = SamplingParams(max_tokens=10, temperature=1.0, seed=3)
    failing = engine.add_request([1, 2], sampled)
    others = [engine.add_request(p, GREEDY) for p in PROMPTS]
    real = runner_module.next_token_distribution

    def fails_for_one(logits, params, *, prompt, output, eos_token_ids):
        if prompt == [1, 2] and len(output) == 2:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(logits, params, prompt=prompt, output=output, eos_token_ids=eos_token_ids)

    monkeypatch.setattr(runner_module, "next_token_distribution", fails_for_one)
    final = {}
    while engine.has_unfinished():
        for output in engine.step():
            assert output.request_id not in final  # nothing after the end
            if output.finished:
                final[output.request_id] = output
    assert [final[i].token_ids for i in others] == _alone(model)
    error = final[failing]
    assert error.finish_reason == "error" and error.new_token_ids == []
    assert len(error.token_ids) == 2
    assert "RuntimeError: probability tensor" in error.error
    assert sorted(f.request_id for f in finished) == others  # an error is no length
    engine.blocks.check()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
