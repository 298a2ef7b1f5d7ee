"""The selector: decisions in serving terms, the min_gain and min_dwell rules, switch costs."""

from pathlib import Path

import numpy as np
import pytest

from blocktune.traces.synth import customer_service_day
from blocktune.tuner.config.calibration import analytic_calibration
from blocktune.tuner.config.policy import load_policy
from blocktune.tuner.core.selector import InvalidBlockSize, Selector
from blocktune.tuner.sim.forecast import CAPACITY_RANGE, Forecaster
from blocktune.tuner.sim.window import LengthWindow

POLICIES = Path(__file__).resolve().parents[3] / "policies"
DEFAULT = load_policy(POLICIES / "default.yaml")
TIGHT = DEFAULT.model_copy(update={"kv_budget": 48 * 2**20})  # 384 token slots: it fills
ANALYTIC = analytic_calibration()


def snapshot_of(prompts, outputs, stamps):
    window = LengthWindow(capacity=max(1, len(prompts)))
    window.observe_many(np.asarray(prompts), np.asarray(outputs), timestamps=np.asarray(stamps))
    return window.snapshot()


def phase_window(phase: str):
    """The embedded day's requests of one phase, with their arrival times."""
    day = customer_service_day(0)
    rows = day[day.phase == phase].tail(DEFAULT.window.capacity)
    return snapshot_of(rows.prompt_tokens, rows.output_tokens, rows.arrival_s)


def promo_window(count: int = 500):
    """Promotion-burst lengths at five requests per second."""
    rng = np.random.default_rng(2)
    return snapshot_of(
        rng.integers(15, 26, count), rng.integers(8, 25, count), np.arange(count) / 5
    )


def test_at_light_load_the_block_size_does_not_matter_and_the_decision_says_so():
    decision = Selector(DEFAULT, ANALYTIC).decide(phase_window("day"), 16, now=0.0)
    assert not decision.switch and not decision.material
    assert decision.recommended_block_size == 16
    assert decision.reason.startswith("at this load every candidate is within 2% of B=16")
    assert decision.reason.endswith("keep B=16")
    capacities = [f.capacity for f in decision.forecasts]
    assert max(capacities) <= min(capacities) * (1 + DEFAULT.min_gain)
    # The cost model's terms still come with every candidate.
    assert {c.block_size for c in decision.candidates} == set(DEFAULT.candidates)


def test_with_the_kv_cache_full_a_promotion_burst_moves_to_8():
    selector = Selector(TIGHT, ANALYTIC)
    decision = selector.decide(promo_window(), 16, now=0.0)
    assert decision.switch and decision.material and decision.block_size == 8
    by_size = {f.block_size: f for f in decision.forecasts}
    assert by_size[8].capacity >= by_size[16].capacity * (1 + TIGHT.min_gain)
    assert decision.gain == pytest.approx(by_size[8].capacity / by_size[16].capacity - 1)
    assert decision.reason.startswith("switch B=16 -> 8: B=8 is ")
    # Why: padding displaces concurrent requests; smaller blocks cost block-table work.
    cost8, cost16 = decision.cost_of(8), decision.cost_of(16)
    assert cost8.padding_ratio < cost16.padding_ratio
    assert cost8.kernel_translation_s_per_token > cost16.kernel_translation_s_per_token
    # A larger minimum gain keeps the size in force and says by how much the best one wins.
    picky = TIGHT.model_copy(update={"min_gain": 0.9})
    kept = Selector(picky, ANALYTIC).decide(promo_window(), 16, now=0.0)
    assert not kept.switch and not kept.material and kept.recommended_block_size == 16
    assert "within 90% of B=16" in kept.reason


def test_the_capacity_is_the_largest_load_within_the_slo():
    forecaster = Forecaster(TIGHT, ANALYTIC)
    workload = forecaster.workload_of(promo_window())
    (forecast,) = forecaster.forecast(workload, 16, (16,))
    assert forecaster.meets(workload, 16, forecast.capacity)
    assert not forecaster.meets(workload, 16, forecast.capacity * 1.03)
    assert forecast.capacity <= forecaster.sustained_load(workload, 16)
    assert forecast.observed.tokens_per_s > 0 and forecast.headroom.ttft_p99_s > 0


def test_a_sample_of_a_second_is_held_to_what_the_server_sustains(llama2_7b_policy):
    """1000 one-line queries at 305 req/s: the forecast's 128 of them span 0.4 s, a burst that
    any block size absorbs within the SLO at any multiple of the load. Held to the request
    rate each size serves when saturated, B=8 fits the most of them and B=64 the fewest."""
    policy = llama2_7b_policy
    rng = np.random.default_rng(0)
    window = snapshot_of(rng.integers(2, 8, 1000), rng.integers(8, 24, 1000), np.arange(1000) / 305)
    forecaster = Forecaster(policy, ANALYTIC)
    workload = forecaster.workload_of(window)
    sustained = [forecaster.sustained_load(workload, b) for b in policy.candidates]
    assert sustained == sorted(sustained, reverse=True)
    assert sustained[0] > 1.1 * sustained[1] and sustained[0] > 2 * sustained[-1]
    decision = Selector(policy, ANALYTIC).decide(window, 64, now=0.0)
    assert decision.switch and decision.block_size == 8
    for forecast, limit in zip(decision.forecasts, sustained, strict=True):
        assert forecast.capacity <= limit < CAPACITY_RANGE[1]


def test_min_dwell_blocks_a_second_switch():
    selector = Selector(TIGHT, ANALYTIC)
    first = selector.decide(promo_window(), 16, now=0.0)
    assert first.switch and selector.last_switch is None  # nothing applied yet
    selector.record_switch(first.decided_at)
    held = selector.decide(promo_window(), 32, now=600.0)
    assert not held.switch and "min_dwell" in held.reason and held.material
    later = selector.decide(promo_window(), 32, now=TIGHT.min_dwell.total_seconds() + 1)
    assert later.switch and later.block_size == 8


def test_a_vllm_restart_must_pay_back_within_the_dwell():
    vllm = TIGHT.model_copy(update={"engine": "vllm", "candidates": (16, 32, 64, 128)})
    slow = vllm.model_copy(update={"restart": vllm.min_dwell})
    kept = Selector(slow, ANALYTIC).decide(promo_window(), 32, now=0.0)
    assert kept.material and not kept.switch and kept.block_size == 16
    assert kept.switch_cost_s == pytest.approx(vllm.min_dwell.total_seconds())
    assert "not more than the switch cost" in kept.reason
    quick = vllm.model_copy(update={"restart": vllm.min_dwell / 1000})
    assert Selector(quick, ANALYTIC).decide(promo_window(), 32, now=0.0).switch


def test_too_few_samples_keep_the_current_size_and_say_why():
    rng = np.random.default_rng(0)
    prompts, outputs = rng.integers(15, 26, 50), rng.integers(8, 25, 50)
    snapshot = snapshot_of(prompts, outputs, np.linspace(0, 300, 50))
    decision = Selector(DEFAULT, ANALYTIC).decide(snapshot, 32, now=0.0)
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


def test_the_decision_as_json_names_its_choice_and_predictions():
    body = Selector(TIGHT, ANALYTIC).decide(promo_window(), 16, now=0.0).to_dict()
    assert body["recommended_block_size"] == 8 and body["material"] is True
    assert body["goal"] == "capacity" and body["goal_higher_is_better"] is True
    for row in body["candidates"]:
        assert {"tokens_per_s", "ttft_p99_s", "tpot_p99_s", "capacity", "headroom"} <= set(row)
        assert isinstance(row["capacity"], float)
