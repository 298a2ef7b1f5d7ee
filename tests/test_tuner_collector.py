"""The collector: scheduled runs, failures counted without stopping, min_samples, switches."""

import time
from pathlib import Path

import numpy as np

from blocktune.tuner.core.calibration import analytic_calibration
from blocktune.tuner.core.policy import load_policy
from blocktune.tuner.core.selector import Selector
from blocktune.tuner.core.window import LengthWindow
from blocktune.tuner.sidecar.scheduler import JOB_ID, Collector

POLICY = load_policy(Path(__file__).resolve().parents[1] / "policies" / "default.yaml")
FAST = POLICY.model_copy(update={"interval": POLICY.interval / 3000})  # 0.1 s


def promo_window(count: int) -> LengthWindow:
    rng = np.random.default_rng(2)
    window = LengthWindow(capacity=POLICY.window.capacity)
    window.observe_many(
        rng.integers(15, 26, count), rng.integers(8, 25, count), timestamps=np.arange(count) * 0.2
    )
    return window


def wait_for(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def test_a_short_interval_produces_decisions_on_a_stable_job():
    decisions = []
    collector = Collector(
        promo_window(500),
        Selector(FAST, analytic_calibration()),
        decisions.append,
        FAST,
        block_size=16,
    )
    collector.start()
    try:
        job = collector.job
        assert job.id == JOB_ID and job.coalesce and job.max_instances == 1
        assert job.trigger.interval.total_seconds() == 0.1
        assert wait_for(lambda: collector.runs >= 3)
    finally:
        collector.stop()
    assert not collector.running and collector.job is None
    assert collector.failures == 0
    first = decisions[0]
    assert first.switch and first.current_block_size == 16 and first.block_size == 8
    # The switch was adopted; later runs start from 8 and keep it.
    assert collector.block_size == 8
    assert all(d.current_block_size == 8 and not d.switch for d in decisions[1:])


def test_a_failing_run_is_counted_and_the_next_run_still_happens():
    calls = []

    def flaky(decision) -> None:
        calls.append(decision)
        if len(calls) == 1:
            raise RuntimeError("actuator unavailable")

    collector = Collector(
        promo_window(500), Selector(FAST, analytic_calibration()), flaky, FAST, block_size=16
    )
    collector.start()
    try:
        assert wait_for(lambda: collector.runs >= 2)
        assert collector.running
    finally:
        collector.stop()
    assert collector.failures == 1
    assert collector.last_error == "RuntimeError: actuator unavailable"
    assert len(calls) >= 3
    # The failed run adopted nothing; the next run made and applied the same switch.
    assert calls[0].switch and calls[1].switch and calls[1].current_block_size == 16
    assert collector.block_size == 8
    assert collector.selector.last_switch == calls[1].decided_at


def test_min_samples_keep_the_current_size():
    decisions = []
    collector = Collector(
        promo_window(POLICY.window.min_samples - 1),
        Selector(POLICY, analytic_calibration()),
        decisions.append,
        POLICY,
        block_size=32,
    )
    decision = collector.run_now()
    assert decisions == [decision] and collector.runs == 1
    assert not decision.switch and collector.block_size == 32
    assert f"only {POLICY.window.min_samples - 1} of the {POLICY.window.min_samples}" in (
        decision.reason
    )


def test_run_now_reports_a_failure_as_none():
    collector = Collector(
        promo_window(200),
        Selector(POLICY, analytic_calibration()),
        lambda decision: None,
        POLICY,
        block_size=24,  # not a power of two: the selector refuses
    )
    assert collector.run_now() is None
    assert collector.failures == 1 and collector.runs == 0
    assert "power of two" in collector.last_error
