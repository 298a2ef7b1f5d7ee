"""The synthetic customer-service day and the block-manager replay."""

import numpy as np
import pandas as pd
import pytest

from blocktune.runtime.block_manager import BlockManager
from blocktune.traces.synth import customer_service_day
from blocktune.tuner.measure.block_replay import drive_block_manager, replay_block_manager


def test_day_is_deterministic_and_has_its_phases():
    day = customer_service_day(7, duration_s=3600, rate_scale=0.05)
    again = customer_service_day(7, duration_s=3600, rate_scale=0.05)
    pd.testing.assert_frame_equal(day, again)
    assert list(day.columns) == [
        "arrival_s",
        "prompt_tokens",
        "output_tokens",
        "phase",
        "prefix_group",
        "prefix_hashes",
    ]
    assert day.arrival_s.is_monotonic_increasing
    assert day.arrival_s.min() >= 0 and day.arrival_s.max() <= 3600
    by_phase = day.groupby("phase").prompt_tokens
    assert by_phase.min()["day"] >= 60 and by_phase.max()["day"] <= 90
    assert by_phase.min()["promo"] >= 15 and by_phase.max()["promo"] <= 25
    docs = day[day.phase == "document"]
    total = docs.prompt_tokens + docs.output_tokens
    assert len(docs) > 0 and total.min() >= 450 and total.max() <= 520
    # The promotion burst arrives faster than the daytime mix.
    hours = day.arrival_s / 3600 * 24
    promo_rate = ((day.phase == "promo").sum()) / 3
    day_rate = ((day.phase == "day").sum()) / 12
    assert promo_rate > 2 * day_rate
    assert ((hours >= 20) & (hours < 23))[day.phase == "promo"].all()


def test_replay_padding_equals_a_brute_force_count():
    day = customer_service_day(3, duration_s=300, rate_scale=0.004)
    for block_size in (8, 32):
        expected = 0
        for prompt, output in zip(day.prompt_tokens, day.output_tokens, strict=True):
            held = np.arange(prompt + 1, prompt + output + 1)
            expected += int((-(-held // block_size) * block_size - held).sum())
        assert replay_block_manager(day, block_size).padding_slot_steps == expected


def test_replay_counts_padding_exactly_for_one_request():
    trace = pd.DataFrame({"arrival_s": [0.0], "prompt_tokens": [5], "output_tokens": [4]})
    stats = replay_block_manager(trace, 4, step_s=1.0)
    # Steps hold 6, 7, 8, 9 tokens -> 2, 2, 2, 3 blocks of 4 slots.
    assert stats.steps == 4
    assert stats.peak_blocks == 3
    assert stats.allocated_slot_steps == 8 + 8 + 8 + 12
    assert stats.padding_slot_steps == 2 + 1 + 0 + 3


def test_replay_smaller_blocks_pad_less_on_the_demo_workload():
    day = customer_service_day(0, duration_s=600, rate_scale=0.01)
    ratios = [replay_block_manager(day, b).padding_ratio for b in (8, 16, 32, 64)]
    assert ratios == sorted(ratios)
    assert 0 < ratios[0] < ratios[-1] < 1


def test_driven_prompts_never_hit_the_prefix_cache():
    """Every driven token has its own id, so prompts of equal length share no cached block:
    each leaves its own 4 full blocks (36 tokens at B=8) in the cache. Prompts of equal ids
    would leave 4 in all, the later ones reusing the first's."""
    manager = BlockManager(64, 8, enable_prefix_caching=True)
    steps = drive_block_manager(manager, np.array([32, 32, 32]), np.array([4, 4, 4]), concurrency=1)
    assert steps == 12
    assert len(manager.cached_blocks()) == 12 and manager.num_free_blocks == 64
    manager.check()


def test_a_pool_too_small_for_the_requests_is_an_error():
    with pytest.raises(RuntimeError, match="no room in the pool for request 1's prompt"):
        drive_block_manager(BlockManager(1, 16), np.array([8, 8]), np.array([1, 1]), concurrency=2)
    with pytest.raises(RuntimeError, match="no room in the pool for a token of request 0"):
        drive_block_manager(BlockManager(1, 16), np.array([16]), np.array([2]), concurrency=1)
