"""Forecasts: capacities bisected finely, bootstrap intervals, and a capacity one can check."""

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from blocktune.traces.loaders import load_trace
from blocktune.traces.synth import customer_service_day
from blocktune.tuner.config.calibration import analytic_calibration
from blocktune.tuner.config.policy import load_policy
from blocktune.tuner.core.recommendation import recommend
from blocktune.tuner.sim.forecast import (
    BOOTSTRAP_RESAMPLES,
    CAPACITY_RANGE,
    CAPACITY_TOLERANCE,
    CHALLENGER_TOLERANCE,
    FAR_SHARE,
    FORECAST_REQUESTS,
    SETTLED_TOLERANCE,
    Forecaster,
    offered_tokens_per_s,
    peak_load,
    window_rate_scale,
)
from blocktune.tuner.sim.window import LengthWindow
from blocktune.tuner.sim.workload import Workload

ROOT = Path(__file__).resolve().parents[3]
DEFAULT = load_policy(ROOT / "policies" / "default.yaml")
TIGHT = DEFAULT.model_copy(update={"kv_budget": 48 * 2**20})  # 384 token slots: it fills
ANALYTIC = analytic_calibration()
SHARED = ROOT.parent / "shared" / "traces"
SHAREGPT = SHARED / "sharegpt_lengths" / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"
AZURE = SHARED / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"


def promo_workload(forecaster: Forecaster) -> Workload:
    rng = np.random.default_rng(2)
    window = LengthWindow(500)
    window.observe_many(
        rng.integers(15, 26, 500), rng.integers(8, 25, 500), timestamps=np.arange(500) / 5
    )
    return forecaster.workload_of(window.snapshot())


def day_window_forecaster() -> tuple[Forecaster, Workload]:
    """The customer-service policy with a 96 MiB pool and the last 1000 requests of the
    embedded day's day phase (`bench/recommend.py`'s slowest window): capacities there are set
    by the SLO, below the sustained loads."""
    policy = load_policy("customer_service_llama8b").model_copy(update={"kv_budget": 96 * 2**20})
    forecaster = Forecaster(policy, ANALYTIC)
    day = customer_service_day(0)
    rows = day[day.phase == "day"].tail(1000)
    window = LengthWindow(1000)
    window.observe_many(
        rows.prompt_tokens.to_numpy(),
        rows.output_tokens.to_numpy(),
        timestamps=rows.arrival_s.to_numpy(),
    )
    return forecaster, forecaster.workload_of(window.snapshot())


@pytest.mark.parametrize("window", ["promotion", "day"])
def test_every_capacity_is_bisected_well_under_min_gain(window):
    """The size in force to 0.2% and its strongest challenger to 0.5% (both well under the 2%
    min_gain), or, far from the size in force, to an eighth of the distance; a size already
    known to be below another challenger only to 5%: the SLO holds at each reported capacity
    and (on the promotion, where it is monotone in the load) fails that fraction above it, so
    no gain is an artefact of the search. A capacity that the sustained load bounds is that
    load exactly. (On the day window a 128-request p99 is not monotone in the load: B=32
    fails at 1.66x and passes again at 1.67x.)"""
    assert DEFAULT.min_gain / 10 >= CAPACITY_TOLERANCE and DEFAULT.min_gain > CHALLENGER_TOLERANCE
    if window == "promotion":
        forecaster = Forecaster(TIGHT, ANALYTIC)
        workload = promo_workload(forecaster)
    else:
        forecaster, workload = day_window_forecaster()
    candidates = forecaster.policy.candidates
    forecasts = forecaster.forecast(workload, 16, candidates)
    reference = next(f.capacity for f in forecasts if f.block_size == 16)
    challenger = max((f for f in forecasts if f.block_size != 16), key=lambda f: f.capacity)
    bound_by_sustained = 0
    for forecast in forecasts:
        size, capacity = forecast.block_size, forecast.capacity
        distance = abs(math.log(capacity / reference))
        tolerance = max(CHALLENGER_TOLERANCE, FAR_SHARE * distance)
        if size == 16:
            tolerance = CAPACITY_TOLERANCE
        elif forecast is not challenger:
            assert capacity < challenger.capacity
            tolerance = max(tolerance, SETTLED_TOLERANCE)
        assert CAPACITY_RANGE[0] < capacity < CAPACITY_RANGE[1]
        assert forecaster.meets(workload, size, capacity)
        if window == "promotion":
            assert not forecaster.meets(workload, size, capacity * (1 + tolerance))
        sustained = forecaster.sustained_load(workload, size)
        if forecaster.meets(workload, size, sustained):
            bound_by_sustained += 1
            assert capacity == sustained
    # the promotion's capacities are all its sustained loads; the day's are all below them
    assert bound_by_sustained == (len(candidates) if window == "promotion" else 0)
    assert challenger.block_size == 8


def test_a_size_below_another_challenger_is_only_bisected_to_the_settled_tolerance():
    """On the day window 32 and 64 are found below 8 (the strongest challenger): once a
    bracket of theirs lies below 8's capacity every further probe is the bracket's geometric
    midpoint (an interpolated probe would sit half the fine tolerance from the crossing,
    which costs probes a 5% answer does not need), and the search stops within 5%."""
    forecaster, workload = day_window_forecaster()
    probes: dict[int, list[float]] = {}
    metrics = forecaster.metrics

    def recorded(sample, block_size, load):
        if sample is workload and load not in (1.0, forecaster.policy.headroom):
            probes.setdefault(block_size, []).append(load)
        return metrics(sample, block_size, load)

    forecaster.metrics = recorded
    forecasts = {f.block_size: f for f in forecaster.forecast(workload, 16, (8, 16, 32, 64))}
    forecaster.metrics = metrics
    settle_at = forecasts[8].capacity
    for size in (32, 64):
        capacity = forecasts[size].capacity
        assert capacity < settle_at
        passed, failed, midpoints = [], [], 0
        for load in probes[size]:
            if passed and failed and min(failed) <= settle_at:
                low = max(x for x in passed if x < min(failed))
                assert load == pytest.approx(math.sqrt(low * min(failed)), rel=1e-12)
                midpoints += 1
            (passed if forecaster.meets(workload, size, load) else failed).append(load)
        assert midpoints >= 1
        above = min(x for x in failed if x > capacity)
        assert above / capacity <= 1 + SETTLED_TOLERANCE


def test_a_headroom_of_one_still_forecasts():
    """With `headroom: 1` the observed and the headroom runs are the same load, so they give
    no slope to step by; the searches still find every capacity the default headroom does
    (within the search's tolerances)."""
    forecaster = Forecaster(TIGHT.model_copy(update={"headroom": 1.0}), ANALYTIC)
    workload = promo_workload(forecaster)
    capacities = {f.block_size: f.capacity for f in forecaster.forecast(workload, 16, (8, 16))}
    default = Forecaster(TIGHT, ANALYTIC)
    expected = {f.block_size: f.capacity for f in default.forecast(workload, 16, (8, 16))}
    assert capacities == pytest.approx(expected, rel=CHALLENGER_TOLERANCE)


def test_intervals_come_from_resamples_of_the_window_and_repeat_exactly():
    """The size in force and its challenger are forecast again on every bootstrap resample;
    each capacity's interval holds its own estimate; the same window gives the same intervals."""
    forecaster = Forecaster(TIGHT, ANALYTIC)
    workload = promo_workload(forecaster)
    first = forecaster.forecast(workload, 16, TIGHT.candidates)
    again = forecaster.forecast(workload, 16, TIGHT.candidates)
    assert [f.capacity_interval for f in first] == [f.capacity_interval for f in again]
    resampled = [f for f in first if f.resampled]
    assert len(resampled) == 2 and resampled[0].block_size in (8, 16)
    for forecast in first:
        low, high = forecast.capacity_interval
        assert low <= forecast.capacity <= high
    for forecast in resampled:
        assert len(forecast.resampled) == BOOTSTRAP_RESAMPLES
        capacities = forecast.values("capacity")
        assert capacities.min() < capacities.max()  # the resamples differ
    samples = forecaster.resamples(workload)
    assert all(np.array_equal(s.arrival_s, workload.arrival_s) for s in samples)
    assert not np.array_equal(samples[0].prompt_tokens, workload.prompt_tokens)


def _window_meets(frame, policy, load: float) -> bool:
    """Whether the SLO holds over the whole of `frame` replayed at B=16 at `load` x its rate."""
    forecaster = Forecaster(policy, ANALYTIC)
    workload = Workload.from_frame(frame.reset_index(drop=True))
    workload = replace(workload, arrival_s=workload.arrival_s - workload.arrival_s[0])
    return forecaster.metrics(workload, 16, load).meets(policy.slo)


CHECKABLE = 1000
"""The requests replayed to check a capacity: the window a default policy keeps."""


@pytest.mark.slow
@pytest.mark.skipif(not SHAREGPT.exists(), reason="../shared/traces is not present")
def test_the_reported_capacity_holds_at_0_9x_and_fails_at_1_1x_on_sharegpt():
    """ShareGPT lengths at 1 request/s, 32 GiB of KV: `recommend` on the last 1000 requests
    reports B=16's capacity; those 1000 requests replayed at 0.9x it meet the SLO, at 1.1x
    they do not (tolerance reached: +-10%; the window's own capacity is 0.93x the reported)."""
    policy = DEFAULT.model_copy(update={"kv_budget": 32 * 2**30})
    frame = load_trace(SHAREGPT, "lengths", rate=1.0, seed=0).frame.tail(CHECKABLE)
    decision, _, _ = recommend(frame, policy, ANALYTIC, current_block_size=16)
    capacity = {f.block_size: f.capacity for f in decision.forecasts}[16]
    assert _window_meets(frame, policy, 0.9 * capacity)
    assert not _window_meets(frame, policy, 1.1 * capacity)


@pytest.mark.slow
@pytest.mark.skipif(not AZURE.exists(), reason="../shared/traces is not present")
def test_the_reported_capacity_holds_at_0_75x_and_fails_at_1_1x_on_the_azure_conversation_trace():
    """The Azure conversation trace, 32 GiB of KV: its last 1000 requests arrive at 3.84 req/s,
    their last 128 (the forecast's sample) at 2.67, so the capacity counts in the selection's
    rate (`window_rate_scale`). Replayed at 0.75x it the window meets the SLO, at 1.1x it does
    not. The tolerance reached is -25%/+10%: the window holds only to 0.79x, its bursts
    lasting minutes, longer than the sample's 48 s."""
    policy = DEFAULT.model_copy(update={"kv_budget": 32 * 2**30})
    frame = load_trace(AZURE, "azure").frame.tail(CHECKABLE)
    decision, _, _ = recommend(frame, policy, ANALYTIC, current_block_size=16)
    capacity = {f.block_size: f.capacity for f in decision.forecasts}[16]
    assert _window_meets(frame, policy, 0.75 * capacity)
    assert not _window_meets(frame, policy, 0.9 * capacity)
    assert not _window_meets(frame, policy, 1.1 * capacity)


def test_a_sample_is_replayed_at_the_window_rate_when_asked():
    """900 requests a second apart, then 100 at 0.25 s, 10 output tokens each: the window
    offers 10.8 tokens/s (999 x 10 over 924.75 s), its last 100 requests 40, so at the
    window's rate their gaps are 3.70x as long; by default they are the recorded ones."""
    stamps = np.concatenate([np.arange(900.0), 900 + np.arange(100) * 0.25])
    outputs = np.full(1000, 10)
    scale = window_rate_scale(stamps, outputs, 100)
    window_rate = 999 * 10 / stamps[-1]
    sample_rate = 99 * 10 / (stamps[-1] - stamps[900])
    assert scale == pytest.approx(sample_rate / window_rate) and scale == pytest.approx(
        3.70, abs=0.01
    )
    window = LengthWindow(1000)
    window.observe_many(np.full(1000, 20), outputs, timestamps=stamps)
    forecaster = Forecaster(DEFAULT, ANALYTIC)
    recorded = forecaster.workload_of(window.snapshot())
    rescaled = forecaster.workload_of(window.snapshot(), at_window_rate=True)
    assert np.allclose(np.diff(recorded.arrival_s[-50:]), 0.25)
    latest = window_rate_scale(stamps, outputs, len(recorded))
    assert np.allclose(rescaled.arrival_s, recorded.arrival_s * latest)


def _window_of(stamps: np.ndarray, outputs: np.ndarray):
    window = LengthWindow(capacity=len(stamps))
    window.observe_many(np.full(len(stamps), 20), outputs, timestamps=stamps)
    return window.snapshot()


def test_peak_load_is_the_busiest_stretch_in_multiples_of_the_load_capacities_count_in():
    """1000 requests a second apart but for 128 of them four times as dense: their stretch
    offers 4x the sample's load (the latest 128 requests, one a second), and over the whole
    window's rate the ratio of the two offered rates; a steady window has no peak (1x)."""
    gaps = np.ones(999)
    gaps[300 : 300 + FORECAST_REQUESTS - 1] = 0.25
    stamps = np.concatenate(([0.0], np.cumsum(gaps)))
    outputs = np.full(1000, 12)
    snapshot = _window_of(stamps, outputs)
    assert peak_load(snapshot) == pytest.approx(4.0)
    window = offered_tokens_per_s(stamps, outputs)
    assert peak_load(snapshot, at_window_rate=True) == pytest.approx(4 * 12 / window)
    assert peak_load(_window_of(np.arange(1000.0), outputs)) == 1.0
    assert peak_load(_window_of(np.arange(1000.0), outputs), at_window_rate=True) == 1.0
    # Fewer requests than a sample: the sample is the window, nothing is busier.
    assert peak_load(_window_of(stamps[:50], outputs[:50])) == 1.0
