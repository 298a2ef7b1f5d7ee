"""The metrics of one served run: latencies and throughput from per-request times, the peak
KV in bytes and blocks and the preemptions from a simulated run, and numpy's percentiles."""

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from blocktune.tuner.config.calibration import analytic_calibration
from blocktune.tuner.config.policy import Policy, SloSettings, load_policy
from blocktune.tuner.sim.served import ServedMetrics, percentiles
from blocktune.tuner.sim.simulator import simulate
from blocktune.tuner.sim.step_cost import StepCostModel
from blocktune.tuner.sim.workload import Workload

POLICY = load_policy(Path(__file__).resolve().parents[3] / "policies" / "default.yaml")


def test_the_metrics_of_per_request_times():
    """Two requests: one of one token (no TPOT), one of three tokens 0.3 s apart."""
    workload = Workload.of_lengths(np.array([0.0, 1.0]), np.array([5, 5]), np.array([1, 3]))
    metrics = ServedMetrics.of_times(
        workload,
        first_token_s=np.array([0.5, 1.2]),
        finish_s=np.array([0.5, 1.8]),
        generated=np.array([1, 3]),
        preemptions=2,
    )
    assert metrics.tokens_per_s == pytest.approx(4 / 1.8)
    assert metrics.ttft_p50_s == pytest.approx(0.35)  # TTFTs 0.5 and 0.2
    assert metrics.ttft_p99_s == pytest.approx(0.2 + 0.99 * 0.3)
    assert metrics.tpot_p50_s == metrics.tpot_p99_s == pytest.approx(0.3)
    assert metrics.e2e_p99_s == pytest.approx(0.5 + 0.99 * 0.3)  # e2e 0.5 and 0.8
    assert (metrics.peak_kv_bytes, metrics.peak_kv_blocks, metrics.preemptions) == (0, 0, 2)
    assert metrics.meets(SloSettings(ttft_p99_s=0.5, tpot_p99_s=0.31))
    assert not metrics.meets(SloSettings(ttft_p99_s=0.49, tpot_p99_s=0.31))
    assert not metrics.meets(SloSettings(ttft_p99_s=0.5, tpot_p99_s=0.29))


def test_a_run_without_a_later_token_has_no_tpot_and_meets_any_tpot_limit():
    workload = Workload.of_lengths(np.array([0.0, 0.5]), np.array([5, 5]), np.array([1, 1]))
    metrics = ServedMetrics.of_times(
        workload, np.array([0.1, 0.6]), np.array([0.1, 0.6]), np.array([1, 1])
    )
    assert math.isnan(metrics.tpot_p50_s) and math.isnan(metrics.tpot_p99_s)
    assert metrics.meets(SloSettings(ttft_p99_s=0.1, tpot_p99_s=1e-3))


def test_the_metrics_of_a_simulated_run_hold_its_peak_in_bytes_and_blocks():
    slot = POLICY.model.kv_bytes_per_token
    tight = Policy.model_validate({**POLICY.model_dump(), "kv_budget": 256 * slot})
    rng = np.random.default_rng(0)
    workload = Workload.of_lengths(
        np.sort(rng.uniform(0, 1, 30)), rng.integers(20, 100, 30), rng.integers(5, 40, 30)
    )
    run = simulate(workload, StepCostModel(tight, analytic_calibration()), 16)
    metrics = ServedMetrics.of(run, workload)
    assert run.preemptions > 0 and metrics.preemptions == run.preemptions
    assert 0 < metrics.peak_kv_blocks == run.peak_blocks <= 256 // 16
    assert metrics.peak_kv_bytes == run.peak_blocks * 16 * slot  # one block size all along
    times = ServedMetrics.of_times(workload, run.first_token_s, run.finish_s, run.generated)
    assert metrics.tokens_per_s == times.tokens_per_s and metrics.e2e_p99_s == times.e2e_p99_s


@given(
    arrays(
        np.float64,
        st.integers(1, 300),
        elements=st.floats(-1e6, 1e6, allow_nan=False) | st.sampled_from([0.0, 1.0, 2.5]),
    ),
    st.lists(st.floats(0, 100), min_size=1, max_size=4),
)
def test_percentiles_are_numpys_bit_for_bit(values, qs):
    """The run metrics' percentiles equal `np.percentile`'s (linear) exactly, ties and ends
    included, and are NaN where a value is."""
    assert percentiles(values, tuple(qs)) == np.percentile(values, qs).tolist()
    with_nan = np.append(values, np.nan)
    assert all(math.isnan(v) for v in percentiles(with_nan, tuple(qs)))
