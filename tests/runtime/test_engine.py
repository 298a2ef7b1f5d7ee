"""The continuous-batching engine: exact tokens across block sizes, preemption, cancellation."""

import copy
import random
from dataclasses import replace

import pytest
import torch

from blocktune.runtime.config import EngineConfig
from blocktune.runtime.engine import Engine
from blocktune.runtime.loading import load_weights
from blocktune.runtime.model import LlamaModel
from blocktune.runtime.requests import FinishedRequest, RequestError, RequestTooLarge
from blocktune.runtime.sampling import SamplingParams


@pytest.fixture(scope="module")
def model():
    return load_weights("tiny-random", seed=0)


def _prompts(count, seed=0, low=3, high=40):
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(low, high))] for _ in range(count)]


def _dense_greedy(model, prompt, max_tokens):
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(int(model.forward_dense(torch.tensor(tokens))[-1].argmax()))
    return tokens[len(prompt) :]


def _run(model, prompts, max_tokens=12, **config):
    engine = Engine(model, EngineConfig(**{"num_blocks": 64, **config}))
    outputs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens))
    engine.blocks.check()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    return [o.token_ids for o in outputs], engine


@pytest.mark.slow
def test_greedy_tokens_match_dense_reference_at_every_block_size(model):
    prompts = _prompts(6)
    expected = [_dense_greedy(model, p, 12) for p in prompts]
    for block_size in (8, 16, 32, 64):
        tokens, _ = _run(model, prompts, block_size=block_size, num_blocks=512 // block_size)
        assert tokens == expected, f"block size {block_size}"


@pytest.mark.slow
def test_tiny_pool_forces_preemption_and_keeps_tokens(model):
    prompts = _prompts(8, seed=1, low=10, high=30)
    expected, _ = _run(model, prompts, max_tokens=20, block_size=8)
    tokens, engine = _run(model, prompts, max_tokens=20, block_size=8, num_blocks=12)
    assert engine.preemptions > 0
    assert tokens == expected


def test_cancelled_requests_do_not_change_survivors(model):
    prompts = _prompts(6, seed=2)
    expected, _ = _run(model, prompts, block_size=16)
    engine = Engine(model, EngineConfig(block_size=16, num_blocks=64))
    ids = [engine.add_request(p, SamplingParams(max_tokens=12)) for p in prompts]
    final = {}
    for step in range(40):
        if step == 3:
            assert engine.cancel(ids[1]) and engine.cancel(ids[4])
            assert not engine.cancel(ids[1])
            engine.blocks.check()
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output.token_ids
    assert sorted(final) == [0, 2, 3, 5]
    assert all(final[i] == expected[i] for i in final)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert not engine.has_unfinished()


@pytest.mark.slow
def test_prefix_caching_reuses_blocks_and_keeps_tokens(model):
    shared = _prompts(1, seed=3, low=40, high=40)[0]
    prompts = [shared + tail for tail in _prompts(4, seed=4, low=2, high=6)]
    expected, _ = _run(model, prompts, block_size=8)
    engine = Engine(model, EngineConfig(block_size=8, num_blocks=64, enable_prefix_caching=True))
    first = engine.generate(prompts[:1], SamplingParams(max_tokens=12))
    rest = engine.generate(prompts[1:], SamplingParams(max_tokens=12))
    assert [o.token_ids for o in first + rest] == expected
    # Each later prompt finds the shared 40 tokens (5 full blocks of 8) in the cache.
    assert engine.stats()["prefix_hit_tokens"] == 3 * 40
    engine.blocks.check()


def test_listeners_receive_finished_lengths_and_stats_are_counted(model):
    engine = Engine(model, EngineConfig(block_size=8, num_blocks=32))
    finished: list[FinishedRequest] = []
    engine.add_listener(finished.append)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=5))
    engine.step()
    stats = engine.stats()
    assert stats["running"] == 1 and stats["blocks_used"] == 1
    assert stats["padding_slots"] == 8 - 3
    while engine.has_unfinished():
        engine.step()
    assert [(f.prompt_tokens, f.output_tokens, f.finish_reason) for f in finished] == [
        (3, 5, "length")
    ]
    assert engine.stats()["blocks_used"] == 0


def test_stop_tokens_and_seeded_sampling_are_deterministic(model):
    prompt = _prompts(1, seed=5)[0]
    greedy, _ = _run(model, [prompt], max_tokens=8, block_size=16)
    stop = greedy[0][3]
    engine = Engine(model, EngineConfig(block_size=16, num_blocks=16))
    [out] = engine.generate([prompt], SamplingParams(max_tokens=8, stop_token_ids=(stop,)))
    assert out.token_ids == greedy[0][: greedy[0].index(stop) + 1]
    assert out.finish_reason == "stop"
    sampled = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=42)
    runs = []
    for block_size in (8, 32):
        engine = Engine(model, EngineConfig(block_size=block_size, num_blocks=256 // block_size))
        runs.append(engine.generate([prompt, prompt], sampled))
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    assert runs[0][0].token_ids == runs[0][1].token_ids


def test_the_models_eos_ids_stop_every_request_unless_ignored(model):
    prompts = _prompts(3, seed=6)
    greedy, _ = _run(model, prompts, max_tokens=10, block_size=16)
    eos = greedy[0][4]
    with_eos = LlamaModel(replace(model.config, eos_token_ids=(eos,)))
    with_eos.load_state_dict(model.state_dict())
    stopped, engine = _run(with_eos, prompts, max_tokens=10, block_size=16)
    assert stopped == [g[: g.index(eos) + 1] if eos in g else g for g in greedy]
    assert stopped[0] == greedy[0][: greedy[0].index(eos) + 1]
    [ignored] = engine.generate([prompts[0]], SamplingParams(max_tokens=10, ignore_eos=True))
    assert (ignored.token_ids, ignored.finish_reason) == (greedy[0], "length")


@pytest.mark.parametrize(
    ("prompt", "params", "needle"),
    [
        ([], SamplingParams(), "empty"),
        (list(range(100)), SamplingParams(), "max_model_len 64"),
        ([1, 256], SamplingParams(), "token id 256"),
        ([1, -1], SamplingParams(), "token id -1"),
        ([1], SamplingParams(max_tokens=0), "max_tokens"),
        ([1], SamplingParams(temperature=-1), "temperature"),
        ([1], SamplingParams(top_p=0), "top_p"),
        ([1], SamplingParams(temperature=1.0, seed=2**70), "seed"),
        ([1], SamplingParams(temperature=1.0, seed=-1), "seed"),
    ],
)
def test_bad_requests_raise_and_engine_keeps_serving(model, prompt, params, needle):
    engine = Engine(model, EngineConfig(block_size=8, num_blocks=16, max_model_len=64))
    with pytest.raises(RequestError, match=needle):
        engine.add_request(prompt, params)
    [out] = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3))
    assert len(out.token_ids) == 3


def test_request_that_can_never_fit_is_rejected(model):
    engine = Engine(model, EngineConfig(block_size=8, num_blocks=4, max_model_len=512))
    with pytest.raises(RequestTooLarge, match="only 4 blocks"):
        engine.add_request(list(range(20)), SamplingParams(max_tokens=40))


def test_bad_engine_config_is_named():
    with pytest.raises(ValueError, match="exactly one"):
        EngineConfig(block_size=16)
    with pytest.raises(ValueError, match="'cuda-magic'"):
        EngineConfig(num_blocks=4, attention_backend="cuda-magic")
    with pytest.raises(ValueError, match="block_size 24"):
        EngineConfig(block_size=24, num_blocks=4)


def test_a_tiny_temperature_samples_the_greedy_token(model):
    prompt = _prompts(1, seed=8)[0]
    greedy, _ = _run(model, [prompt], max_tokens=6, block_size=8)
    engine = Engine(model, EngineConfig(block_size=8, num_blocks=32))
    [out] = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=1e-300, seed=1))
    assert out.token_ids == greedy[0]


def test_generate_is_all_or_nothing(model):
    engine = Engine(model, EngineConfig(block_size=8, num_blocks=32))
    with pytest.raises(RequestError, match="empty"):
        engine.generate([[1, 2], [3], []], SamplingParams(max_tokens=2))
    assert not engine.has_unfinished() and engine.stats()["waiting"] == 0


def test_padding_counts_each_sequences_unused_tail_even_with_shared_blocks(model):
    shared = list(range(1, 17))
    engine = Engine(model, EngineConfig(block_size=8, num_blocks=32, enable_prefix_caching=True))
    for tail in ([40], [41, 42], [43, 44, 45]):
        engine.add_request(shared + tail, SamplingParams(max_tokens=4))
    engine.step()
    # 17, 18 and 19 tokens in blocks of 8: 7 + 6 + 5 unused slots in the last blocks.
    assert engine.stats()["padding_slots"] == 7 + 6 + 5


@pytest.mark.slow
def test_chunked_prefill_keeps_tokens_within_the_step_budget(model, monkeypatch):
    prompts = _prompts(10, seed=9, low=30, high=120)
    expected, _ = _run(model, prompts, max_tokens=16, block_size=8, num_blocks=256)
    steps = []  # per step: (decodes, prefill chunk sizes)
    forward_step = model.forward_step

    def counting(token_ids, *args, **kwargs):
        steps.append((kwargs["block_table"].shape[0], [n for n, _ in kwargs["chunks"]]))
        assert len(token_ids) == steps[-1][0] + sum(steps[-1][1])
        return forward_step(token_ids, *args, **kwargs)

    monkeypatch.setattr(model, "forward_step", counting)
    config = EngineConfig(block_size=8, num_blocks=256, max_num_seqs=8, max_num_batched_tokens=40)
    engine = Engine(model, config)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=16))
    assert [o.token_ids for o in outputs] == expected
    assert max(decodes + sum(chunks) for decodes, chunks in steps) == 40
    # Prompts of up to 120 tokens ran in chunks, and chunks shared steps with decodes.
    assert sum(map(len, prompts)) == sum(sum(chunks) for _, chunks in steps)
    assert any(decodes and chunks for decodes, chunks in steps)
    engine.blocks.check()


@pytest.mark.slow
def test_chunked_prefill_survives_preemption_in_a_tiny_pool(model):
    prompts = _prompts(8, seed=10, low=20, high=50)
    expected, _ = _run(model, prompts, max_tokens=20, block_size=8)
    tokens, engine = _run(
        model, prompts, max_tokens=20, block_size=8, num_blocks=16, max_num_batched_tokens=32
    )
    assert engine.preemptions > 0
    assert tokens == expected


def test_chunked_prefill_settings_are_checked():
    with pytest.raises(ValueError, match="max_num_batched_tokens 16 is below max_num_seqs 32"):
        EngineConfig(num_blocks=4, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(num_blocks=4, max_num_batched_tokens=64, enable_prefix_caching=True)


def test_cpu_backend_gives_the_torch_backends_logits_for_short_chunks_and_whole_prompts(
    model, monkeypatch
):
    """Prompts that share a cached prefix leave short prefill tails, which the cpu backend
    attends in place next to decodes and whole prompts: every step's logits are the torch
    backend's, to within rounding, and so are the tokens."""
    from blocktune.kernels.paged_attention import KernelInputError, require_cpu_kernel
    from blocktune.runtime import model as model_module

    try:
        require_cpu_kernel("cpu")
    except KernelInputError as error:  # no C compiler here
        pytest.skip(str(error))
    shared = _prompts(1, seed=4, low=24, high=24)[0]
    tails = _prompts(6, seed=5, low=1, high=12)
    prompts = [shared + [1]] + [shared + tail for tail in tails] + _prompts(3, seed=6, low=30)
    short_rows, logits = [], {"torch": [], "cpu": []}
    of = model_module._ShortChunks.of
    forward_step = model.forward_step

    def spy(*args):
        found = of(*args)
        short_rows.append(0 if found is None else len(found.lens))
        return found

    def recording(*args, **kwargs):
        out = forward_step(*args, **kwargs)
        logits[kwargs["backend"]].append(out)
        return out

    monkeypatch.setattr(model_module._ShortChunks, "of", spy)
    monkeypatch.setattr(model, "forward_step", recording)
    tokens = {}
    for backend in ("torch", "cpu"):
        engine = Engine(
            model,
            EngineConfig(
                block_size=8, num_blocks=128, enable_prefix_caching=True, attention_backend=backend
            ),
        )
        engine.generate(prompts[:1], SamplingParams(max_tokens=1))  # caches the shared blocks
        outputs = engine.generate(prompts[1:], SamplingParams(max_tokens=10))
        tokens[backend] = [o.token_ids for o in outputs]
        assert engine.prefix_hit_tokens >= 6 * 24
    assert tokens["cpu"] == tokens["torch"]
    assert len(logits["cpu"]) == len(logits["torch"]) > 10
    for cpu, reference in zip(logits["cpu"], logits["torch"], strict=True):
        torch.testing.assert_close(cpu, reference, atol=1e-5, rtol=1e-5)
    assert sum(short_rows) >= sum(map(len, tails))  # the tails went through the C kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layer_operators_give_the_torch_operators_logits_and_tokens(
    model, monkeypatch, dtype
):
    """On a CPU the layers' norms, rotary embedding and SwiGLU run as fused C calls
    (`blocktune.kernels.cpu_layer_ops`); with torch's operators instead, the logits agree to
    rounding and greedy decoding (paged, at two block sizes) picks the same tokens."""
    from blocktune.kernels.cpu_layer_ops import fused_ops_apply
    from blocktune.runtime import model as model_module

    typed = copy.deepcopy(model).to(dtype)  # the fixture stays float32
    tokens = torch.tensor(_prompts(1, seed=8, low=30, high=30)[0])
    with torch.inference_mode():
        if not fused_ops_apply(typed.model.embed_tokens(tokens)):
            pytest.skip("the fused operators do not run here (no C compiler)")
    fused_logits = typed.forward_dense(tokens)
    fused_tokens = [_run(typed, _prompts(4, seed=9), block_size=b)[0] for b in (8, 32)]
    monkeypatch.setattr(model_module, "fused_ops_apply", lambda x: False)
    torch_logits = typed.forward_dense(tokens)
    torch_tokens = [_run(typed, _prompts(4, seed=9), block_size=b)[0] for b in (8, 32)]
    tolerance = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(fused_logits, torch_logits, atol=tolerance, rtol=tolerance)
    if dtype == torch.float32:
        assert fused_tokens == torch_tokens
    assert fused_tokens[0] == fused_tokens[1]  # the block size changes nothing
