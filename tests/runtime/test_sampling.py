"""The sampler's distribution against a reference computation written from the definitions
(OpenAI's penalties and logit_bias, vLLM's repetition_penalty, min_tokens, top_k, min_p),
and the engine applying it."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from blocktune.runtime.config import EngineConfig
from blocktune.runtime.engine import Engine
from blocktune.runtime.loading import load_pretrained
from blocktune.runtime.sampling import SamplingParams, next_token_distribution

VOCAB = 12
EOS = (11,)


def reference(logits, params: SamplingParams, prompt, output) -> np.ndarray:
    """The distribution, token by token, in plain Python and numpy."""
    z = [float(x) for x in logits]
    for token, bias in params.logit_bias.items():
        z[token] += bias
    if len(output) < params.min_tokens:
        for token in [*params.stop_token_ids, *([] if params.ignore_eos else EOS)]:
            z[token] = -np.inf
    seen = set(prompt) | set(output)
    for token in range(VOCAB):
        if token in seen:
            p = params.repetition_penalty
            z[token] = z[token] / p if z[token] > 0 else z[token] * p
        count = output.count(token)
        z[token] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
    z = np.array(z)
    if not np.isfinite(z).any():  # no token left: the model's own likeliest, whatever asked
        z = np.array([float(x) for x in logits])
        params = SamplingParams(temperature=0.0)
    if params.temperature == 0:
        out = np.zeros(VOCAB)
        out[int(np.argmax(z))] = 1.0
        return out
    e = np.exp((z - z.max()) / params.temperature)
    probs = e / e.sum()
    keep = probs >= params.min_p * probs.max()
    if params.top_k:
        keep &= probs >= np.sort(probs)[::-1][params.top_k - 1]
    probs = np.where(keep, probs, 0.0)
    probs /= probs.sum()
    if params.top_p < 1:
        order = np.argsort(-probs, kind="stable")
        mass, kept = 0.0, np.zeros(VOCAB, dtype=bool)
        for token in order:
            if mass >= params.top_p:
                break
            kept[token] = True
            mass += probs[token]
        probs = np.where(kept, probs, 0.0)
    return probs / probs.sum()


tokens = st.lists(st.integers(0, VOCAB - 1), max_size=8)
params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.3, 1.0, 1.7]),
    top_p=st.sampled_from([1.0, 0.9, 0.5, 0.1]),
    top_k=st.sampled_from([0, 1, 3, 8]),
    min_p=st.sampled_from([0.0, 0.05, 0.3]),
    min_tokens=st.integers(0, 4),
    ignore_eos=st.booleans(),
    stop_token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=2).map(tuple),
    presence_penalty=st.floats(-2, 2),
    frequency_penalty=st.floats(-2, 2),
    repetition_penalty=st.floats(0.5, 2.0),
    logit_bias=st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=3),
)


@settings(max_examples=300, deadline=None)
@given(
    logits=st.lists(
        st.floats(-8, 8).map(lambda x: round(x, 3)), min_size=VOCAB, max_size=VOCAB, unique=True
    ),
    params=params,
    prompt=tokens.filter(bool),
    output=tokens,
)
def test_the_distribution_matches_the_reference(logits, params, prompt, output):
    got = next_token_distribution(
        torch.tensor(logits), params, prompt=prompt, output=output, eos_token_ids=EOS
    ).numpy()
    want = reference(logits, params, prompt, output)
    # Ties after the penalties can differ at the cut of top_k / top_p: compare the kept mass.
    assert got.sum() == pytest.approx(1.0)
    assert np.abs(got - want).max() < 1e-9 or _tied(got, want)


def _tied(got: np.ndarray, want: np.ndarray) -> bool:
    kept = (got > 0) | (want > 0)
    return bool(np.allclose(np.sort(got[kept]), np.sort(want[kept]), atol=1e-9))


def test_each_knob_moves_the_distribution_as_defined():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0] + [-5.0] * (VOCAB - 4))

    def dist(output=(), **kw):
        p = SamplingParams(temperature=1.0, **kw)
        return next_token_distribution(
            logits, p, prompt=[5], output=list(output), eos_token_ids=EOS
        )

    base = dist()
    assert dist(logit_bias={3: 100.0})[3] > 0.999  # +100 all but forces a token
    assert dist(logit_bias={0: -100.0})[0] < 1e-40  # -100 all but bans it
    assert dist(top_k=2).nonzero().flatten().tolist() == [0, 1]
    assert dist(top_k=2)[0] == pytest.approx(base[0] / (base[0] + base[1]))
    assert dist(min_p=0.5).nonzero().flatten().tolist() == [0]  # e**-1 < 0.5 of the likeliest
    repeated = dist(output=[0, 0, 0], frequency_penalty=1.0)
    assert repeated[0] / repeated[1] == pytest.approx(float(base[0] / base[1]) * np.exp(-3))
    present = dist(output=[0, 0, 0], presence_penalty=1.0)
    assert present[0] / present[1] == pytest.approx(float(base[0] / base[1]) * np.exp(-1))
    halved = dist(output=[0], repetition_penalty=2.0)  # logit 3 -> 1.5
    assert halved[0] / halved[1] == pytest.approx(np.exp(-0.5))
    eos_first = torch.full((VOCAB,), -5.0)
    eos_first[11] = 5.0
    early = next_token_distribution(
        eos_first, SamplingParams(min_tokens=2), prompt=[1], output=[4], eos_token_ids=EOS
    )
    assert early[11] == 0 and early.sum() == 1
    late = next_token_distribution(
        eos_first, SamplingParams(min_tokens=2), prompt=[1], output=[4, 4], eos_token_ids=EOS
    )
    assert late[11] == 1


def test_a_penalty_near_zero_still_gives_a_distribution():
    """5e-324 divides logit 3 past float64's range (schemathesis sent it): the token seen
    becomes the only one drawn, not a NaN."""
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0] + [-5.0] * (VOCAB - 4))
    params = SamplingParams(temperature=1.0, repetition_penalty=5e-324)
    probs = next_token_distribution(logits, params, prompt=[0], output=[], eos_token_ids=EOS)
    assert torch.isfinite(probs).all() and probs.sum() == pytest.approx(1.0)
    assert probs[0] == 1.0


@pytest.fixture(scope="module")
def engine():
    return Engine(load_pretrained("tiny-random").model, EngineConfig(block_size=8, num_blocks=64))


def test_the_engine_applies_bias_penalties_and_min_tokens(engine):
    def generate(**params) -> list[int]:
        (output,) = engine.generate([[5, 6, 7, 8]], SamplingParams(**params))
        return output.token_ids

    assert generate(max_tokens=5, logit_bias={42: 100.0}) == [42] * 5
    # A presence penalty larger than the logits' spread never picks a token twice.
    assert len(set(generate(max_tokens=8, presence_penalty=50.0))) == 8
    stop = {"stop_token_ids": (42,), "logit_bias": {42: 100.0}, "max_tokens": 6}
    assert generate(**stop) == [42]
    held = generate(**stop, min_tokens=3)
    assert len(held) == 4 and held[-1] == 42 and 42 not in held[:3]


def test_the_engine_refuses_out_of_range_settings(engine):
    from blocktune.runtime.requests import RequestError

    vocab = engine.model.config.vocab_size
    for bad, message in (
        (SamplingParams(top_k=-1), "top_k"),
        (SamplingParams(min_p=1.5), "min_p"),
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
        (SamplingParams(logit_bias={vocab: 1.0}), "outside the vocabulary"),
    ):
        with pytest.raises(RequestError, match=message):
            engine.add_request([1, 2], bad)
