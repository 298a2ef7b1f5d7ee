"""The cost model: closed-form decode sums, capacity, every term and the heuristics."""

import math
from datetime import datetime, timezone

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blocktune.traces.synth import customer_service_day
from blocktune.tuner.config.calibration import Calibration
from blocktune.tuner.config.policy import Policy
from blocktune.tuner.measure.block_replay import replay_block_manager
from blocktune.tuner.sim.cost_model import (
    CostModel,
    EmptyWindow,
    article_heuristic,
    block_steps,
    nearest_power_of_two,
    token_steps,
)

SIZES = (8, 16, 32, 64)
SHAPE = {"num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "dtype": "float16"}
SLOT_BYTES = 2 * 2 * 2 * 8 * 2  # K and V x layers x KV heads x head_dim x dtype bytes = 128


def make_policy(budget: str = "1MiB", **fields) -> Policy:
    return Policy(
        deployment="test",
        model={**SHAPE, "num_params": 1e6},
        kv_budget=budget,
        candidates=list(SIZES),
        **fields,
    )


def make_calibration(**overrides) -> Calibration:
    fields = {
        "provenance": {
            "kind": "analytic",
            "device": "test",
            "date": datetime(2026, 1, 1, tzinfo=timezone.utc),
            "sources": ["hand-picked round numbers"],
        },
        "kernel_shape": {"num_kv_heads": 2, "head_dim": 8, "dtype": "float16"},
        "memory_bandwidth_bytes_per_s": 1e9,
        "compute_flops_per_s": 1e12,
        "copy_bandwidth_bytes_per_s": 5e8,
        "kernel": {
            b: {"launch_s": 1e-6, "per_block_s": 1e-8 * b, "per_token_s": 2e-9} for b in SIZES
        },
        "host_s_per_token": {b: 1e-6 / b for b in SIZES},
    }
    fields.update(overrides)
    return Calibration(**fields)


def brute_force(prompts, outputs, block_size):
    held = blocks = 0
    for p, o in zip(prompts, outputs, strict=True):
        for length in range(p + 1, p + o + 1):
            held += length
            blocks += -(-length // block_size)
    return held, blocks


@settings(max_examples=80, deadline=None)
@given(
    requests=st.lists(st.tuples(st.integers(1, 700), st.integers(0, 300)), min_size=1, max_size=8),
    block_size=st.sampled_from([1, 2, 8, 16, 64, 256]),
)
def test_closed_form_sums_equal_a_token_by_token_count(requests, block_size):
    prompts = np.array([p for p, _ in requests])
    outputs = np.array([o for _, o in requests])
    held, blocks = brute_force(prompts, outputs, block_size)
    assert int(token_steps(prompts, outputs).sum()) == held
    assert int(block_steps(prompts, outputs, block_size).sum()) == blocks


def test_padding_ratio_matches_a_replay_through_the_block_manager():
    day = customer_service_day(3, duration_s=300, rate_scale=0.004)
    model = CostModel(make_policy(), make_calibration())
    costs = model.costs(day.prompt_tokens.to_numpy(), day.output_tokens.to_numpy())
    for cost in costs:
        replay = replay_block_manager(day, cost.block_size)
        assert cost.padding_ratio == pytest.approx(replay.padding_ratio, rel=1e-12)


def test_one_request_by_hand():
    # prompt 10, output 3: the request holds 11, 12 and 13 tokens in its three decode steps.
    model = CostModel(make_policy(budget="1MiB"), make_calibration())
    cost = {c.block_size: c for c in model.costs(np.array([10]), np.array([3]))}[8]
    held, allocated, generated = 11 + 12 + 13, 3 * 2 * 8, 3
    assert cost.padding_ratio == pytest.approx((allocated - held) / allocated)  # 12 / 48
    assert cost.padding_slots_per_request == pytest.approx(12 / 3)
    assert cost.padding_bytes_per_request == pytest.approx(4 * SLOT_BYTES)
    assert cost.allocated_slots_per_request == pytest.approx(16)
    capacity = 2**20 // SLOT_BYTES  # 8192 slots, a multiple of every block size
    assert cost.capacity_slots == capacity
    assert cost.capacity_tokens == pytest.approx(capacity * held / allocated)
    assert cost.padding_bytes_in_budget == pytest.approx(2**20 * 12 / 48)
    assert cost.concurrent_requests == pytest.approx(capacity / 16)
    weights_s = 1e6 * 2 / 1e9  # 1e6 fp16 weights at 1 GB/s
    assert cost.weights_s_per_token == pytest.approx((weights_s + 2 * 1e-6) / (capacity / 16))
    # Two layers; blocks held 2+2+2, tokens 36, over 3 generated tokens. The calibration's
    # K/V shape equals the policy's, so no scaling.
    assert cost.kernel_translation_s_per_token == pytest.approx(2 * 8e-8 * 6 / generated)
    assert cost.kernel_bandwidth_s_per_token == pytest.approx(2 * 2e-9 * held / generated)
    assert cost.host_s_per_token == pytest.approx(1e-6 / 8)
    assert cost.prefix_loss_tokens == 0 and cost.prefix_loss_s_per_token == 0
    assert cost.objective_s_per_token == pytest.approx(
        cost.weights_s_per_token + cost.kernel_s_per_token + cost.host_s_per_token
    )


def test_capacity_uses_whole_blocks_of_the_budget():
    budget = 1000 * SLOT_BYTES + 5  # 1000 slots and a few bytes
    model = CostModel(make_policy(budget=str(budget)), make_calibration())
    assert [model.capacity_slots(b) for b in SIZES] == [1000, 992, 992, 960]


def test_prefix_loss_is_half_a_block_per_shared_prefix():
    model = CostModel(make_policy(), make_calibration())
    costs = model.costs(np.array([300, 300]), np.array([50, 30]), shared_prefixes=3)
    prefill_s_per_token = 2 * 1e6 / 1e12
    for cost in costs:
        assert cost.prefix_loss_tokens == pytest.approx(3 * (cost.block_size - 1) / 2)
        assert cost.prefix_loss_s_per_token == pytest.approx(
            cost.prefix_loss_tokens * prefill_s_per_token / 80
        )


def test_kernel_coefficients_scale_with_the_models_kv_bytes():
    policy = Policy(
        deployment="wide",
        model={**SHAPE, "num_kv_heads": 4, "num_params": 1e6},
        kv_budget="1MiB",
        candidates=list(SIZES),
    )
    scaled = CostModel(policy, make_calibration()).kernel(16)
    assert scaled.per_block_s == pytest.approx(2 * 16e-8)
    assert scaled.per_token_s == pytest.approx(2 * 2e-9)
    assert scaled.launch_s == pytest.approx(1e-6)


def test_a_window_without_generated_tokens_has_no_cost():
    model = CostModel(make_policy(), make_calibration())
    with pytest.raises(EmptyWindow, match="2 requests"):
        model.costs(np.array([5, 7]), np.array([0, 0]))


def test_the_seed_heuristic_exactly_as_stated():
    # The seed's example: median 500 tokens, head_dim 128, 32 heads, fp16.
    seed = article_heuristic(500, head_dim=128, num_heads=32, dtype_bytes=2, candidates=SIZES)
    assert seed.value_sqrt_token_bytes == pytest.approx(math.sqrt(500 * 128 * 32 * 2 * 2))
    assert round(seed.value_sqrt_token_bytes) == 2862  # not the 1280 the seed prints
    assert seed.bytes_per_token == 16384
    assert seed.tokens == pytest.approx(math.sqrt(500 / 16384))  # below one token
    assert seed.block_size == min(SIZES)
    # The seed's 1280 is what a length of 100 tokens gives.
    hundred = article_heuristic(100, head_dim=128, num_heads=32, dtype_bytes=2, candidates=SIZES)
    assert hundred.value_sqrt_token_bytes == pytest.approx(1280)


def test_nearest_power_of_two_clamps_and_rounds_in_log_space():
    assert nearest_power_of_two(0.2, SIZES) == 8
    assert nearest_power_of_two(11.0, SIZES) == 8  # log2 11 = 3.46
    assert nearest_power_of_two(12.0, SIZES) == 16  # log2 12 = 3.58
    assert nearest_power_of_two(5000.0, SIZES) == 64


def test_principled_prior_is_the_optimum_of_padding_against_per_block_cost():
    policy = make_policy()
    model = CostModel(policy, make_calibration())
    optimum, block = model.principled_block_size(400.0)
    c_block = 2 * np.mean([1e-8 * b for b in SIZES])
    c_pad = (1e6 * 2 / 1e9) * SLOT_BYTES / 2**20
    assert optimum == pytest.approx(math.sqrt(2 * c_block * 400 / c_pad))
    assert block == nearest_power_of_two(optimum, SIZES)


def test_huge_windows_do_not_wrap_around():
    """80,000 requests of 2**24 output tokens: int64 sums of held slot-steps would wrap."""
    prompts = np.ones(80_000, dtype=np.int64)
    outputs = np.full(80_000, 2**24 - 1, dtype=np.int64)
    assert int(token_steps(prompts, outputs).sum()) < 0  # what numpy's int64 sum gives
    [cost] = CostModel(make_policy(), make_calibration()).costs(prompts, outputs, block_sizes=(16,))
    assert 0 <= cost.padding_ratio < 1e-3
