"""The selector: decisions in serving terms, the min_gain and min_dwell rules, switch costs."""

from pathlib import Path

import numpy as np
import pytest

from blocktune.traces.synth import customer_service_day
from blocktune.tuner.config.calibration import analytic_calibration
from blocktune.tuner.config.policy import load_policy
from blocktune.tuner.core.selector import InvalidBlockSize, Selector
from blocktune.tuner.sim.forecast import (
    CAPACITY_RANGE,
    SUSTAINED,
    Estimate,
    Forecast,
    Forecaster,
    noise_interval,
)
from blocktune.tuner.sim.served import ServedMetrics
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
    assert decision.reason.startswith(
        "only 50 of the 100 requests a decision needs are in the window: keep B=32"
    )
    empty = Selector(DEFAULT, ANALYTIC).decide(LengthWindow(10).snapshot(), 32, now=0.0)
    assert empty.block_size == 32 and not empty.switch and empty.candidates == []
    assert empty.reason == "no request in the window yet: keep B=32"


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


def _metrics(ttft_p99_s: float = 0.1) -> ServedMetrics:
    return ServedMetrics(100.0, 0.05, ttft_p99_s, 0.05, 0.06, 1.0, 0, 0, 0)


def _forecast(size: int, capacity: float, resampled: list[float], tokens_per_s: float = 100.0):
    estimates = tuple(Estimate(c, tokens_per_s * c / capacity, 0.1) for c in resampled)
    interval = noise_interval(np.array(resampled), capacity)
    return Forecast(size, _metrics(), _metrics(), capacity, tokens_per_s, estimates, interval)


def _decide_with(forecasts, current: int, policy=DEFAULT, snapshot=None):
    """The selector's decision on `snapshot` (the promotion window), its forecasts replaced by
    `forecasts`."""
    selector = Selector(policy, ANALYTIC)
    selector.forecaster.forecast = lambda workload, current, sizes: forecasts
    return selector.decide(promo_window() if snapshot is None else snapshot, current, now=0.0)


def test_a_gain_within_the_forecasts_noise_keeps_the_size_in_force():
    """B=64 is 3% better on the sample, but over the resamples -1% to +6%: no switch, and the
    reason says it is noise."""
    forecasts = [
        _forecast(16, 2.0, [2.0, 2.1, 1.9, 2.0]),
        _forecast(64, 2.06, [1.98, 2.23, 2.0, 2.05]),
        *(_forecast(b, 1.5, [1.5] * 4) for b in (8, 32, 128)),
    ]
    decision = _decide_with(forecasts, 16)
    assert decision.gain == pytest.approx(0.03)
    low, high = decision.gain_interval
    assert low < DEFAULT.min_gain < high
    assert not decision.switch and not decision.material
    assert decision.recommended_block_size == 16
    assert "within the forecast's noise" in decision.reason and decision.reason.endswith("B=16")
    body = decision.to_dict()
    assert body["gain_interval"] == [pytest.approx(low), pytest.approx(high)]
    assert all(len(row["capacity_interval"]) == 2 for row in body["candidates"])


def test_a_gain_beyond_the_noise_switches_and_going_back_needs_one_too():
    """B=64 is 5-8% better on every resample: switch. From 64, 16 is worse: keep 64 (no flip
    back). Had the resamples put 16 within the noise of 64, it would stay too."""
    forecasts = [
        _forecast(16, 2.0, [2.0, 2.1, 1.9, 2.0]),
        _forecast(64, 2.14, [2.12, 2.26, 2.0, 2.15]),
        *(_forecast(b, 1.5, [1.5] * 4) for b in (8, 32, 128)),
    ]
    decision = _decide_with(forecasts, 16)
    assert decision.switch and decision.material and decision.block_size == 64
    assert decision.gain_interval[0] > DEFAULT.min_gain
    assert decision.reason.startswith("switch B=16 -> 64: B=64 is ")
    assert "beyond the forecast's noise" in decision.reason
    back = _decide_with(forecasts, 64)
    assert not back.switch and back.recommended_block_size == 64
    assert back.reason.startswith("B=64 is the best candidate on capacity")
    noisy = [
        _forecast(16, 2.06, [1.98, 2.23, 2.0, 2.05]),
        _forecast(64, 2.0, [2.0, 2.1, 1.9, 2.0]),
        *(_forecast(b, 1.5, [1.5] * 4) for b in (8, 32, 128)),
    ]
    assert not _decide_with(noisy, 64).switch


def test_overloaded_the_sizes_are_ranked_by_what_they_still_serve():
    """Every capacity below 1x (on the search's floor): rank by saturated tokens/s; 8 serves
    10% more on every resample, so it is material and the reason says how it ranked."""
    floor = CAPACITY_RANGE[0]
    forecasts = [_forecast(b, floor, [floor] * 4, tokens_per_s=100.0) for b in (16, 32, 64, 128)]
    forecasts.append(_forecast(8, floor, [floor] * 4, tokens_per_s=110.0))
    decision = _decide_with(forecasts, 16)
    assert decision.ranked_by == SUSTAINED
    assert decision.reason.startswith("switch B=16 -> 8: overloaded (B=16 serves")
    assert "ranking by sustained tokens/s" in decision.reason
    assert decision.switch and decision.material and decision.block_size == 8
    assert decision.gain == pytest.approx(0.10)
    same = [_forecast(b, floor, [floor] * 4) for b in DEFAULT.candidates]
    kept = _decide_with(same, 16)
    assert not kept.material and kept.recommended_block_size == 16
    assert "nan" not in kept.reason


def test_at_the_edge_of_the_slo_a_gain_under_min_gain_beyond_the_noise_switches():
    """B=16 serves 1.00-1.09x the load (less margin than min_gain) and B=128 0.8% more on every
    resample: under min_gain, but there it keeps requests within the SLO, so it is material
    and the reason says why. The same gain with ample capacity keeps 16; from 128, 16 is worse
    (no flip back)."""
    edge = [
        _forecast(16, 1.05, [1.0, 1.05, 1.09]),
        _forecast(128, 1.0584, [1.008, 1.0584, 1.0987]),
        *(_forecast(b, 1.0, [1.0] * 3) for b in (8, 32, 64)),
    ]
    decision = _decide_with(edge, 16)
    assert decision.gain == pytest.approx(0.008)
    assert 0 < decision.gain_interval[0] < DEFAULT.min_gain
    assert decision.switch and decision.material and decision.block_size == 128
    assert "at the edge of the SLO (B=16 serves 1.01-1.08x" in decision.reason
    assert decision.reason.endswith("beyond the forecast's noise and the bar 0.5%")
    ample = [
        _forecast(16, 3.15, [3.0, 3.15, 3.27]),
        _forecast(128, 3.1752, [3.024, 3.1752, 3.2962]),
        *(_forecast(b, 3.0, [3.0] * 3) for b in (8, 32, 64)),
    ]
    kept = _decide_with(ample, 16)
    assert not kept.material and kept.recommended_block_size == 16
    assert "every candidate is within 2% of B=16" in kept.reason
    back = _decide_with(edge, 128)
    assert not back.switch and back.recommended_block_size == 128


def test_a_window_whose_busiest_stretch_exceeds_the_capacity_is_at_the_edge():
    """The same forecasts as the ample case above (B=16 serves 3.0-3.27x the sample's load,
    128 0.8% more), on a window that held 128 requests ten times as dense as its latest ones:
    that stretch offered 10x the load, beyond B=16's capacity, so a backlog built there and the
    0.8% is material; on the evenly spaced promotion window it is not."""
    ample = [
        _forecast(16, 3.15, [3.0, 3.15, 3.27]),
        _forecast(128, 3.1752, [3.024, 3.1752, 3.2962]),
        *(_forecast(b, 3.0, [3.0] * 3) for b in (8, 32, 64)),
    ]
    rng = np.random.default_rng(2)
    gaps = np.full(499, 0.2)
    gaps[100:227] = 0.02
    stamps = np.concatenate(([0.0], np.cumsum(gaps)))
    burst = snapshot_of(rng.integers(15, 26, 500), np.full(500, 16), stamps)
    decision = _decide_with(ample, 16, snapshot=burst)
    assert decision.peak_load == pytest.approx(10.0)
    assert decision.to_dict()["peak_load"] == pytest.approx(10.0)
    assert decision.switch and decision.material and decision.block_size == 128
    assert "busiest 128 requests offered 10x it" in decision.reason
    steady = _decide_with(ample, 16)
    assert steady.peak_load < 1.1 and not steady.material  # its outputs vary, not its gaps
