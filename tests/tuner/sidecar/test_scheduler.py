"""The decision scheduler and the selector's decide-apply-record step it runs in the sidecar."""

import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

from blocktune.tuner.config.calibration import analytic_calibration
from blocktune.tuner.config.policy import load_policy
from blocktune.tuner.core.selector import Selector
from blocktune.tuner.sidecar.scheduler import JOB_ID, DecisionScheduler
from blocktune.tuner.sim.window import LengthWindow

# The default policy with a KV budget small enough to fill (384 token slots): there the block
# size matters, and a promotion burst's short requests serve best at B=8.
POLICY = load_policy(Path(__file__).resolve().parents[3] / "policies" / "default.yaml").model_copy(
    update={"kv_budget": 48 * 2**20}
)
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


class Loop:
    """A minimal sidecar: the block size in force, the selector's step, an `apply`."""

    def __init__(self, policy, window, block_size, apply=lambda decision: decision.block_size):
        self.selector = Selector(policy, analytic_calibration())
        self.window, self.block_size, self.apply = window, block_size, apply
        self.decisions = []

    def run(self):
        decision, self.block_size = self.selector.step(
            self.window.snapshot(), self.block_size, self.apply
        )
        self.decisions.append(decision)
        return decision


def test_a_short_interval_produces_decisions_on_a_stable_job():
    loop = Loop(FAST, promo_window(500), 16)
    scheduler = DecisionScheduler(loop.run, FAST.interval)
    scheduler.start()
    try:
        job = scheduler.job
        assert job.id == JOB_ID and job.coalesce and job.max_instances == 1
        assert job.trigger.interval.total_seconds() == 0.1
        assert wait_for(lambda: scheduler.runs >= 3)
    finally:
        scheduler.stop()
    assert not scheduler.running and scheduler.job is None
    assert scheduler.failures == 0
    first = loop.decisions[0]
    assert first.switch and first.current_block_size == 16 and first.block_size == 8
    # The switch was applied; later runs start from 8 and keep it.
    assert loop.block_size == 8
    assert all(d.current_block_size == 8 and not d.switch for d in loop.decisions[1:])
    assert loop.selector.last_switch == first.decided_at


def test_a_failing_run_is_counted_and_the_next_run_still_happens():
    calls = []

    def flaky(decision) -> int:
        calls.append(decision)
        if len(calls) == 1:
            raise RuntimeError("actuator unavailable")
        return decision.block_size

    loop = Loop(FAST, promo_window(500), 16, apply=flaky)
    scheduler = DecisionScheduler(loop.run, FAST.interval)
    scheduler.start()
    try:
        assert wait_for(lambda: scheduler.runs >= 2)
        assert scheduler.running
    finally:
        scheduler.stop()
    assert scheduler.failures == 1
    assert scheduler.last_error == "RuntimeError: actuator unavailable"
    assert len(calls) == 2
    # The failed run adopted nothing; the next run made and applied the same switch.
    assert calls[0].switch and calls[1].switch and calls[1].current_block_size == 16
    assert loop.block_size == 8
    assert loop.selector.last_switch == calls[1].decided_at


def test_a_switch_that_does_not_take_effect_is_not_recorded():
    loop = Loop(POLICY, promo_window(500), 16, apply=lambda decision: 16)  # the swap failed
    decision = loop.run()
    assert decision.switch and decision.block_size == 8
    assert loop.block_size == 16 and loop.selector.last_switch is None


def test_min_samples_keep_the_current_size():
    loop = Loop(POLICY, promo_window(POLICY.window.min_samples - 1), 32)
    scheduler = DecisionScheduler(loop.run, POLICY.interval)
    decision = scheduler.run_now()
    assert loop.decisions == [decision] and scheduler.runs == 1
    assert not decision.switch and loop.block_size == 32
    assert f"only {POLICY.window.min_samples - 1} of the {POLICY.window.min_samples}" in (
        decision.reason
    )


def test_run_now_reports_a_failure_as_none():
    loop = Loop(POLICY, promo_window(200), 24)  # not a power of two: the selector refuses
    scheduler = DecisionScheduler(loop.run, POLICY.interval)
    assert scheduler.run_now() is None
    assert scheduler.failures == 1 and scheduler.runs == 0
    assert "power of two" in scheduler.last_error


def test_run_soon_runs_now_then_every_interval_from_then():
    """An hour's interval: nothing runs at the start; `run_soon` (the sidecar calls it when its
    window first holds min_samples) runs at once and schedules the next run an hour later."""
    runs = []
    scheduler = DecisionScheduler(lambda: runs.append(time.time()), timedelta(hours=1))
    scheduler.run_soon()  # not started: nothing happens
    scheduler.start()
    try:
        assert scheduler.runs == 0
        asked = time.time()
        scheduler.run_soon()
        assert wait_for(lambda: scheduler.runs == 1)
        next_run = scheduler.job.next_run_time.timestamp()
        assert next_run == pytest.approx(runs[0] + 3600, abs=5) and runs[0] >= asked - 1
    finally:
        scheduler.stop()
