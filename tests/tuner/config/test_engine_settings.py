"""One source of the engine's settings: a policy's engine fields reach the EngineConfig the
worker builds and the simulator alike, and a flag replaces one field, not the others."""

import numpy as np
import pandas as pd
import pytest
import yaml
from pydantic import ValidationError

from blocktune.runtime.engine import Engine
from blocktune.runtime.loading import load_weights
from blocktune.tuner.cli import build_parser
from blocktune.tuner.cli.worker import config_from_args
from blocktune.tuner.config.calibration import analytic_calibration
from blocktune.tuner.config.defaults import DEFAULT_CANDIDATES, DEFAULT_KV_BYTES
from blocktune.tuner.config.engine_settings import engine_settings
from blocktune.tuner.config.policy import Policy, load_policy
from blocktune.tuner.fidelity.live import serve_live
from blocktune.tuner.replay.runner import plan_replay, static_name
from blocktune.tuner.sim.simulator import simulate
from blocktune.tuner.sim.step_cost import StepCostModel
from blocktune.tuner.sim.workload import Workload

STEP_S = 0.25  # exact in binary: both sides' clocks add it up exactly
TINY_RANDOM = {  # tiny-random's shape: 2 x 2 x 16 x 4 bytes x (K, V) = 512 bytes a token
    "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
    "dtype": "float32", "num_params": 1e5,
}  # fmt: skip
SHARED = {  # every engine field away from its default, the prefix cache left to the rule
    "deployment": "engine-settings",
    "model": TINY_RANDOM,
    "kv_budget": "3MiB",  # 6144 token slots
    "candidates": [8, 32, 64],
    "server": {"initial_block_size": 32},  # not the candidate nearest 16 (8)
}
CHUNKED = {**SHARED, "batch": {"max_num_seqs": 5, "max_num_batched_tokens": 96}}
UNCACHED = {**SHARED, "batch": {"max_num_seqs": 5, "enable_prefix_caching": False}}
CACHED = {**SHARED, "batch": {"max_num_seqs": 5}}


@pytest.fixture(scope="module")
def model():
    return load_weights("tiny-random", seed=0)


def _worker_engine(tmp_path, policy: dict, *flags: str):
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    args = build_parser().parse_args(["worker", "--policy", str(path), *flags])
    return config_from_args(args).engine


def _requests(arrivals, prompts, outputs, hashes=None) -> Workload:
    frame = {"arrival_s": arrivals, "prompt_tokens": prompts, "output_tokens": outputs}
    if hashes is not None:
        frame["prefix_hashes"] = pd.Series(hashes, dtype=object)
    return Workload.from_frame(pd.DataFrame(frame))


def _both_sides(model, tmp_path, policy: dict, workload: Workload):
    """`workload` served live on the engine the worker builds from `policy` and simulated
    under `policy`, both at constant step times from the worker's starting size."""
    config = _worker_engine(tmp_path, policy)
    live = serve_live(Engine(model, config), workload, step_s=STEP_S)
    server = StepCostModel(Policy.model_validate(policy), analytic_calibration(), STEP_S)
    return live, simulate(workload, server, config.block_size)


@pytest.mark.parametrize(
    ("policy", "tokens"), [(CHUNKED, 96), (UNCACHED, None)], ids=["chunked", "uncached"]
)
def test_the_worker_builds_its_engine_from_every_engine_field_of_the_policy(
    tmp_path, policy, tokens
):
    config = _worker_engine(tmp_path, policy)
    assert (config.kv_bytes, config.num_blocks) == (3 * 2**20, None)
    assert (config.block_size, config.candidate_block_sizes) == (32, (8, 32, 64))
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (5, tokens)
    assert config.enable_prefix_caching is False  # chunked prefill turns it off by default


def test_the_pool_starting_size_and_candidates_are_the_engines_in_the_simulator(model, tmp_path):
    config = _worker_engine(tmp_path, CHUNKED)
    policy = Policy.model_validate(CHUNKED)
    server = StepCostModel(policy, analytic_calibration())
    engine = Engine(model, config)
    assert engine.kv.num_slots == server.capacity_slots(32) == 6144
    assert engine.blocks.num_blocks == server.num_blocks(32) == 192
    frame = pd.DataFrame(
        {"arrival_s": [0.0, 1.0], "prompt_tokens": [9, 9], "output_tokens": [3, 3]}
    )
    plan = plan_replay(frame, policy, analytic_calibration())
    assert plan.initial == config.block_size == 32  # the adaptive replay starts there too
    assert plan.names[:3] == tuple(static_name(b) for b in config.candidate_block_sizes)


@pytest.mark.parametrize("policy", [CHUNKED, UNCACHED], ids=["chunked", "uncached"])
def test_the_batch_limits_bind_the_engine_and_the_simulator_alike(model, tmp_path, policy):
    burst = _requests([0.0] * 12, [4] * 12, [3] * 12)
    live, run = _both_sides(model, tmp_path, policy, burst)
    np.testing.assert_array_equal(live.first_token_s, run.first_token_s)
    assert np.sum(run.first_token_s == STEP_S) == 5  # batch.max_num_seqs in the first step
    long_prompt = _requests([0.0], [400], [2])
    live, run = _both_sides(model, tmp_path, policy, long_prompt)
    # 96 tokens a step: a 400-token prompt makes its first token in its fifth step.
    steps = 5 if policy is CHUNKED else 1
    assert live.first_token_s[0] == run.first_token_s[0] == steps * STEP_S


@pytest.mark.parametrize(
    ("policy", "hits"),
    [(CACHED, 256), (UNCACHED, 0), (CHUNKED, 0)],
    ids=["cached", "uncached", "chunked"],
)
def test_the_prefix_cache_field_holds_for_the_engine_and_the_simulator_alike(
    model, tmp_path, policy, hits
):
    """Two 300-token prompts sharing one 256-token prefix hash, the second after the first
    finished: it finds the prefix cached on both sides, or on neither."""
    workload = _requests([0.0, 10.0], [300, 300], [2, 2], [[7], [7]])
    live, run = _both_sides(model, tmp_path, policy, workload)
    assert live.prefix_hit_tokens == run.prefix_hit_tokens == hits
    assert _worker_engine(tmp_path, policy).enable_prefix_caching is bool(hits)


def test_a_flag_replaces_its_field_and_leaves_the_policys_others(tmp_path):
    policy = _worker_engine(tmp_path, CHUNKED)
    fields = ("kv_bytes", "block_size", "candidate_block_sizes", "max_num_seqs")
    fields += ("max_num_batched_tokens", "enable_prefix_caching")
    for flags, changed in [
        (["--max-num-seqs", "7"], {"max_num_seqs": 7}),
        (["--block-size", "8"], {"block_size": 8}),
        (["--kv-bytes", "1MiB"], {"kv_bytes": 2**20}),
        (["--candidates", "16", "64"], {"candidate_block_sizes": (16, 32, 64)}),
        (["--max-num-batched-tokens", "128"], {"max_num_batched_tokens": 128}),
    ]:
        config = _worker_engine(tmp_path, CHUNKED, *flags)
        expected = {name: changed.get(name, getattr(policy, name)) for name in fields}
        assert {name: getattr(config, name) for name in fields} == expected, flags
    uncached = _worker_engine(tmp_path, UNCACHED, "--enable-prefix-caching")
    assert uncached.enable_prefix_caching and uncached.max_num_seqs == 5


def test_without_a_policy_the_engine_takes_the_defaults():
    settings = engine_settings(None)
    assert (settings.kv_bytes, settings.block_size) == (DEFAULT_KV_BYTES, 16)
    assert settings.candidates == DEFAULT_CANDIDATES
    assert (settings.max_num_seqs, settings.max_num_batched_tokens) == (64, None)
    assert settings.enable_prefix_caching  # off only where prefills are chunked
    assert not engine_settings(None, max_num_batched_tokens=256).enable_prefix_caching
    sized = engine_settings(None, num_blocks=10, block_size=8, candidates=(32,))
    assert (sized.kv_bytes, sized.num_blocks, sized.candidates) == (None, 10, (8, 32))


def test_a_vllm_policy_has_vllms_defaults_and_no_blocktune_engine():
    data = {**load_policy().model_dump(), "engine": "vllm", "candidates": [16, 32, 64]}
    vllm = engine_settings(Policy.model_validate(data))
    assert (vllm.max_num_seqs, vllm.max_num_batched_tokens) == (256, 2048)
    assert vllm.enable_prefix_caching  # vLLM keeps its prefix cache with chunked prefill
    with pytest.raises(ValueError, match="models engine vllm"):
        vllm.engine_config()
    batch = {**data, "batch": {"max_num_seqs": 8, "enable_prefix_caching": True}}
    assert engine_settings(Policy.model_validate(batch)).max_num_seqs == 8


def test_a_blocktune_policy_refuses_chunked_prefill_with_the_prefix_cache():
    batch = {"max_num_batched_tokens": 96, "enable_prefix_caching": True}
    with pytest.raises(ValidationError, match="cannot combine max_num_batched_tokens"):
        Policy.model_validate({**SHARED, "batch": batch})
