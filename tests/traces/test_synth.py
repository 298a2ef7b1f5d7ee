"""The synthetic customer-service day: rates, daily cycle, prefixes, scaling, writing it out."""

import time

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blocktune.traces.loaders import TraceError, load_trace
from blocktune.traces.schema import PREFIX_BLOCK_TOKENS
from blocktune.traces.synth import (
    CUSTOMER_SERVICE_PHASES,
    DAY_S,
    Phase,
    WorkloadError,
    customer_service_day,
)
from blocktune.traces.writers import write_trace


@pytest.fixture(scope="module")
def full_day():
    return customer_service_day(11)


def test_each_phase_draws_its_mean_rate_over_its_window(full_day):
    for name in ("day", "promo", "document"):
        (phase,) = [p for p in CUSTOMER_SERVICE_PHASES if p.name == name]
        expected = phase.rate_per_s * (phase.end_h - phase.start_h) * 3600
        count = int((full_day.phase == name).sum())
        assert abs(count - expected) < 5 * np.sqrt(expected), name
    night_hours = sum(p.end_h - p.start_h for p in CUSTOMER_SERVICE_PHASES if p.name == "night")
    night_expected = 0.3 * night_hours * 3600
    assert abs((full_day.phase == "night").sum() - night_expected) < 5 * np.sqrt(night_expected)


def test_the_daytime_mix_follows_the_daily_cycle(full_day):
    (phase,) = [p for p in CUSTOMER_SERVICE_PHASES if p.name == "day"]
    hours = full_day.arrival_s[full_day.phase == "day"] / 3600
    counts = np.bincount(hours.astype(int), minlength=24)[8:20]
    centres = np.arange(8, 20) + 0.5
    grid = np.linspace(0, 1, 101)
    expected = np.array(
        [phase.rate_per_s * 3600 * phase.rate_factor(h - 0.5 + grid).mean() for h in centres]
    )
    assert np.all(np.abs(counts - expected) < 5 * np.sqrt(expected))
    assert counts.argmax() + 8 in (13, 14)  # the peak of the cycle is 14:00
    assert counts[5:7].mean() > 1.3 * counts[[0, 11]].mean()


def test_the_promotion_burst_is_short_queries_at_three_times_the_day_rate(full_day):
    promo = full_day[full_day.phase == "promo"]
    day = full_day[full_day.phase == "day"]
    assert promo.prompt_tokens.between(15, 25).all()
    assert day.prompt_tokens.between(60, 90).all()
    assert (promo.arrival_s / 3600).between(20, 23).all()
    promo_rate, day_rate = len(promo) / (3 * 3600), len(day) / (12 * 3600)
    assert promo_rate / day_rate == pytest.approx(3.0, rel=0.05)


def test_documents_share_256_token_prefixes_by_group(full_day):
    docs = full_day[full_day.phase == "document"]
    others = full_day[full_day.phase != "document"]
    total = docs.prompt_tokens + docs.output_tokens
    assert total.between(450, 520).all()
    assert (docs.prompt_tokens - 256).between(30, 54).all()
    assert docs.output_tokens.min() >= 1
    assert docs.prefix_group.nunique() == 8
    assert {len(h) for h in docs.prefix_hashes} == {256 // PREFIX_BLOCK_TOKENS}
    hash_of_group = docs.groupby("prefix_group").prefix_hashes.agg(lambda s: {h[0] for h in s})
    assert all(len(hashes) == 1 for hashes in hash_of_group)
    assert len(set.union(*hash_of_group)) == 8  # one hash per group, groups differ
    assert others.prefix_group.isna().all()
    assert all(h == [] for h in others.prefix_hashes)


def test_duration_only_rescales_the_timeline():
    real = customer_service_day(5, rate_scale=0.02)
    hour = customer_service_day(5, duration_s=3600, rate_scale=0.02)
    np.testing.assert_allclose(hour.arrival_s, real.arrival_s * 3600 / DAY_S)
    pd.testing.assert_frame_equal(hour.drop(columns="arrival_s"), real.drop(columns="arrival_s"))
    assert hour.arrival_s.min() >= 0 and hour.arrival_s.max() <= 3600


def test_rate_scale_multiplies_the_number_of_requests():
    small = len(customer_service_day(2, rate_scale=0.01))
    large = len(customer_service_day(2, rate_scale=0.04))
    assert large / small == pytest.approx(4.0, rel=0.1)


def test_a_full_day_is_generated_quickly():
    start = time.perf_counter()
    day = customer_service_day(0)
    elapsed = time.perf_counter() - start
    assert len(day) > 150_000
    assert elapsed < 2.0


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    duration=st.floats(1.0, 2 * DAY_S),
    low=st.integers(1, 50),
    width=st.integers(0, 50),
    diurnal=st.floats(0, 1),
    start=st.floats(0, 23),
)
def test_custom_phases_keep_their_ranges(seed, duration, low, width, diurnal, start):
    phases = (
        Phase("a", start, 24.0, 0.05, (low, low + width), (1, 3), diurnal=diurnal),
        Phase(
            "b",
            0.0,
            24.0,
            0.02,
            (low + 300, low + width + 300),
            None,
            total_tokens=(low + width + 301, low + width + 400),
            shared_prefix_tokens=256,
            prefix_groups=3,
        ),
    )
    day = customer_service_day(seed, duration_s=duration, phases=phases)
    assert day.arrival_s.is_monotonic_increasing
    assert day.arrival_s.between(0, duration).all()
    a, b = day[day.phase == "a"], day[day.phase == "b"]
    assert (a.arrival_s >= start * 3600 * duration / DAY_S * (1 - 1e-12)).all()
    assert a.prompt_tokens.between(low, low + width).all()
    assert (b.prompt_tokens + b.output_tokens).between(low + width + 301, low + width + 400).all()
    assert (b.output_tokens >= 1).all()
    assert set(b.prefix_group) <= {"doc-0", "doc-1", "doc-2"}


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"start_h": 20.0, "end_h": 8.0}, "window 20.0-8.0 h"),
        ({"rate_per_s": -1.0}, "rate_per_s -1.0"),
        ({"diurnal": 1.5}, "diurnal 1.5"),
        ({"prompt_tokens": (0, 5)}, r"prompt_tokens \(0, 5\)"),
        ({"output_tokens": (9, 3)}, r"output_tokens \(9, 3\)"),
        ({"total_tokens": (100, 200)}, "exactly one of output_tokens and total_tokens"),
        ({"output_tokens": None, "total_tokens": (80, 200)}, "leaves no output"),
        ({"shared_prefix_tokens": 100, "prefix_groups": 1}, "not a multiple of 256"),
        ({"shared_prefix_tokens": 256, "prefix_groups": 1}, "leaves no question"),
        ({"shared_prefix_tokens": 256, "prompt_tokens": (300, 310)}, "prefix_groups must be"),
    ],
)
def test_a_bad_phase_is_a_workload_error_naming_the_field(changes, pattern):
    fields = {
        "name": "x",
        "start_h": 0.0,
        "end_h": 1.0,
        "rate_per_s": 1.0,
        "prompt_tokens": (60, 90),
        "output_tokens": (1, 5),
    }
    with pytest.raises(WorkloadError, match=pattern):
        Phase(**{**fields, **changes})


@pytest.mark.parametrize(
    "kwargs", [{"duration_s": 0}, {"duration_s": float("inf")}, {"rate_scale": -2}]
)
def test_bad_scaling_is_a_workload_error(kwargs):
    with pytest.raises(WorkloadError, match=next(iter(kwargs))):
        customer_service_day(0, **kwargs)
    assert issubclass(WorkloadError, ValueError)


@pytest.mark.parametrize("name", ["day.csv", "day.jsonl", "day.parquet"])
def test_a_written_day_loads_back_with_its_prefixes(tmp_path, name):
    day = customer_service_day(4, duration_s=3600, rate_scale=0.02)
    write_trace(day, tmp_path / name)
    loaded = load_trace(tmp_path / name)
    assert loaded.format == name.split(".")[1]
    assert loaded.skipped == {} and loaded.warnings == []
    frame = loaded.frame
    np.testing.assert_allclose(frame.arrival_s, day.arrival_s - day.arrival_s.iloc[0], atol=1e-9)
    for column in ("prompt_tokens", "output_tokens", "prefix_group", "prefix_hashes"):
        assert frame[column].tolist() == day[column].tolist(), column


def test_writing_to_an_unknown_extension_is_a_trace_error(tmp_path):
    with pytest.raises(TraceError, match=r"day\.xlsx: cannot tell the output format"):
        write_trace(customer_service_day(0, rate_scale=0.001), tmp_path / "day.xlsx")
