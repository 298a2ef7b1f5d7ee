"""The selector: the seed's story, monotonicity in length, switching rules, no flapping."""

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blocktune.traces.synth import customer_service_day
from blocktune.tuner.core.calibration import analytic_calibration
from blocktune.tuner.core.policy import load_policy
from blocktune.tuner.core.selector import InvalidBlockSize, Selector
from blocktune.tuner.core.window import LengthWindow

POLICIES = Path(__file__).resolve().parents[1] / "policies"
DEFAULT = load_policy(POLICIES / "default.yaml")
ANALYTIC = analytic_calibration()
PERIOD = max(DEFAULT.candidates)


def snapshot_of(prompts, outputs, *, span_s: float = 300.0, groups=None):
    window = LengthWindow(capacity=max(1, len(prompts)))
    window.observe_many(
        np.asarray(prompts),
        np.asarray(outputs),
        timestamps=np.linspace(0.0, span_s, len(prompts)),
        prefix_groups=groups,
    )
    return window.snapshot()


def uniform_window(first_prompt: int, output: int, period: int = PERIOD):
    """Prompts covering one period of residues (every candidate's by default), one output."""
    repeat = -(-DEFAULT.window.min_samples // period)
    prompts = np.tile(np.arange(first_prompt, first_prompt + period), repeat)
    return snapshot_of(prompts, np.full(len(prompts), output))


def phase_window(phase: str):
    day = customer_service_day(0)
    rows = day[day.phase == phase].tail(DEFAULT.window.capacity)
    return snapshot_of(rows.prompt_tokens, rows.output_tokens, span_s=0.0)


def test_the_seed_story_daytime_mix_16_promotion_burst_8():
    selector = Selector(DEFAULT, ANALYTIC, clock=lambda: 0.0)
    day = selector.decide(phase_window("day"), 16)
    assert day.block_size == 16 and not day.switch
    assert day.reason == "B=16 is already the cheapest candidate"
    promo = selector.decide(phase_window("promo"), 16)
    assert promo.block_size == 8 and promo.switch  # a shrink moves no data
    assert promo.swap_cost_s == 0.0 and promo.predicted_gain_s > 0
    # The measured choice agrees with the principled prior; the article's rule is clamped.
    assert (day.prior_block_size, promo.prior_block_size) == (16, 8)
    assert day.article_heuristic.tokens < 1 and day.article_heuristic.block_size == 8
    # Why: padding costs concurrency (weights term) and small blocks cost block-table work.
    cost8, cost16 = promo.cost_of(8), promo.cost_of(16)
    assert cost8.weights_s_per_token < cost16.weights_s_per_token
    assert cost8.kernel_translation_s_per_token > cost16.kernel_translation_s_per_token
    assert cost8.padding_ratio < cost16.padding_ratio


@settings(max_examples=40, deadline=None)
@given(
    first_prompt=st.integers(2, 3000),
    shorter_by=st.integers(1, 3000),
    output=st.integers(1, 400),
)
def test_uniformly_shorter_requests_never_get_a_larger_block(first_prompt, shorter_by, output):
    shorter_by = min(shorter_by, first_prompt - 1)
    selector = Selector(DEFAULT, ANALYTIC, clock=lambda: 0.0)
    longer = selector.decide(uniform_window(first_prompt, output), 16).block_size
    shorter = selector.decide(uniform_window(first_prompt - shorter_by, output), 16).block_size
    assert shorter <= longer


def boundary_windows():
    """Windows (prompts over one 16-token period) just below and just above the first
    prompt length where 16 beats 8."""
    selector = Selector(DEFAULT, ANALYTIC, clock=lambda: 0.0)
    first = 1
    while selector.decide(uniform_window(first, 8, period=16), 16).block_size == 8:
        first += 1
    assert first > 3
    return uniform_window(first - 2, 8, period=16), uniform_window(first + 2, 8, period=16)


def simulate(policy, windows, intervals: int, start_block: int = 16):
    selector = Selector(policy, ANALYTIC)
    current, switches = start_block, []
    step = policy.interval.total_seconds()
    for k in range(intervals):
        decision = selector.decide(windows[k % 2], current, now=k * step)
        if decision.switch:
            selector.record_switch(decision.decided_at)
            current = decision.block_size
            switches.append(k * step)
    return switches


def test_no_flapping_on_a_window_that_alternates_around_a_boundary():
    below, above = boundary_windows()
    selector = Selector(DEFAULT, ANALYTIC, clock=lambda: 0.0)
    assert selector.decide(below, 16).block_size == 8
    assert selector.decide(above, 16).block_size == 16
    # Without a dwell and without a swap cost the selector would follow every window.
    eager = DEFAULT.model_copy(update={"min_dwell": DEFAULT.min_dwell * 0, "safety_factor": 0})
    assert len(simulate(eager, (below, above), 12)) == 12
    # The swap-cost margin alone stops it: growing back pays a copy for a tiny gain ...
    no_dwell = DEFAULT.model_copy(update={"min_dwell": DEFAULT.min_dwell * 0})
    assert len(simulate(no_dwell, (below, above), 24)) <= 1
    # ... and the policy's dwell bounds the switches whatever the gains.
    switches = simulate(DEFAULT, (below, above), 24)
    assert len(switches) <= 24 * 300 / DEFAULT.min_dwell.total_seconds()
    assert np.all(np.diff(switches) >= DEFAULT.min_dwell.total_seconds())


def test_min_dwell_blocks_a_second_switch():
    selector = Selector(DEFAULT, ANALYTIC)
    promo, day = phase_window("promo"), phase_window("day")
    first = selector.decide(promo, 16, now=0.0)
    assert first.switch and selector.last_switch is None  # nothing applied yet
    assert selector.decide(promo, 16, now=1.0).switch
    selector.record_switch(first.decided_at)
    assert selector.last_switch == 0.0
    held = selector.decide(promo, 32, now=600.0)
    assert not held.switch and "min_dwell" in held.reason
    later = selector.decide(promo, 32, now=DEFAULT.min_dwell.total_seconds() + 1)
    assert later.switch and later.block_size == 8
    assert not selector.decide(day, 16, now=1e6).switch


def test_a_grow_must_pay_for_its_copy():
    cautious = DEFAULT.model_copy(update={"safety_factor": 1e9})
    decision = Selector(cautious, ANALYTIC).decide(phase_window("day"), 8, now=0.0)
    assert decision.block_size == 16 and not decision.switch
    # The swap cost: every live token's KV at the current size over the copy bandwidth.
    moved = decision.cost_of(8).capacity_tokens * DEFAULT.model.kv_bytes_per_token
    assert decision.swap_cost_s == pytest.approx(moved / ANALYTIC.copy_bandwidth_bytes_per_s)
    assert "swap cost" in decision.reason
    # An engine whose grows copy a measured share of the live KV pays that share.
    aligned = cautious.model_copy(update={"grow_copy_fraction": 0.25})
    quarter = Selector(aligned, ANALYTIC).decide(phase_window("day"), 8, now=0.0)
    assert quarter.swap_cost_s == pytest.approx(decision.swap_cost_s / 4)
    free = cautious.model_copy(update={"grow_copy_fraction": 0.0, "safety_factor": 1.0})
    switched = Selector(free, ANALYTIC).decide(phase_window("day"), 8, now=0.0)
    assert switched.swap_cost_s == 0.0 and switched.switch and switched.block_size == 16


def test_too_few_samples_keep_the_current_size_and_say_why():
    rng = np.random.default_rng(0)
    prompts, outputs = rng.integers(15, 26, 50), rng.integers(8, 25, 50)
    decision = Selector(DEFAULT, ANALYTIC).decide(snapshot_of(prompts, outputs), 32, now=0.0)
    assert not decision.switch and decision.current_block_size == 32
    assert decision.block_size == decision.prior_block_size == 8  # the prior speaks
    assert "only 50 of the 100" in decision.reason and "keep B=32" in decision.reason
    empty = Selector(DEFAULT, ANALYTIC).decide(LengthWindow(10).snapshot(), 32, now=0.0)
    assert empty.block_size == 32 and not empty.switch and empty.candidates == []


def test_the_current_size_must_be_a_power_of_two():
    with pytest.raises(InvalidBlockSize, match="24"):
        Selector(DEFAULT, ANALYTIC).decide(phase_window("day"), 24)


@pytest.mark.parametrize("current", [4, 512])
def test_a_size_in_force_without_calibrated_costs_is_left_for_the_cheapest_candidate(current):
    assert current not in ANALYTIC.block_sizes
    decision = Selector(DEFAULT, ANALYTIC).decide(phase_window("day"), current, now=0.0)
    assert decision.switch and decision.block_size == 16
    assert "no calibrated costs" in decision.reason
    assert {c.block_size for c in decision.candidates} == set(DEFAULT.candidates)
