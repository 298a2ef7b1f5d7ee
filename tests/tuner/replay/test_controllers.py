"""The adaptive controller decides first when its window holds min_samples, then every interval."""

from pathlib import Path

import numpy as np

from blocktune.tuner.config.calibration import analytic_calibration
from blocktune.tuner.config.policy import load_policy
from blocktune.tuner.replay.controllers import DECISION_TICKS, AdaptiveController

ROOT = Path(__file__).resolve().parents[3]
POLICY = load_policy(ROOT / "policies" / "default.yaml")


def test_the_first_decision_comes_at_min_samples_then_every_interval():
    n = 3 * POLICY.window.min_samples
    rng = np.random.default_rng(0)
    prompts, outputs = rng.integers(60, 90, n), rng.integers(20, 60, n)
    controller = AdaptiveController(POLICY, analytic_calibration(), prompts, outputs, [None] * n)
    tick = controller.interval_s
    assert tick * DECISION_TICKS == POLICY.interval.total_seconds()
    finished = 0
    for boundary in range(1, 3 * DECISION_TICKS):
        now = boundary * tick
        # Five requests finish per tick: min_samples is reached after min_samples / 5 ticks.
        rows = np.arange(finished, min(finished + 5, n))
        finished += len(rows)
        controller.observe(rows, np.full(len(rows), now))
        assert controller.decide(now, boundary, 16) in POLICY.candidates
    first = POLICY.window.min_samples // 5
    times = [p.t_s for p in controller.timeline]
    assert times[0] == first * tick
    assert np.diff(times).tolist() == [POLICY.interval.total_seconds()] * (len(times) - 1)
    assert len(times) == 1 + (3 * DECISION_TICKS - 1 - first) // DECISION_TICKS
