"""The sidecar decides as soon as its window first holds min_samples requests."""

import time
from pathlib import Path

import numpy as np

from blocktune.tuner.config.policy import load_policy
from blocktune.tuner.sidecar.sidecar import Sidecar

POLICY = load_policy(Path(__file__).resolve().parents[3] / "policies" / "default.yaml")


def observations(count: int) -> list[dict]:
    rng = np.random.default_rng(0)
    return [
        {"prompt_tokens": int(p), "output_tokens": int(o), "timestamp": 1.7e9 + 0.2 * i}
        for i, (p, o) in enumerate(
            zip(rng.integers(60, 90, count), rng.integers(20, 60, count), strict=True)
        )
    ]


def test_the_first_decision_comes_at_min_samples_not_an_interval_later():
    """A 5-minute interval: below min_samples nothing is decided; the push that brings the
    window to min_samples starts a decision at once, and the next one is an interval later."""
    sidecar = Sidecar(POLICY)
    sidecar.start()
    try:
        below = POLICY.window.min_samples - 1
        sidecar.push(observations(below))
        time.sleep(0.2)
        assert sidecar.scheduler.runs == 0
        assert sidecar.recommendation()["reason"] == "no decision yet"
        sidecar.push(observations(1))
        deadline = time.monotonic() + 30
        while sidecar.scheduler.runs == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sidecar.scheduler.runs == 1
        body = sidecar.recommendation()
        assert body["samples"] == POLICY.window.min_samples and "gain_interval" in body
        interval = POLICY.interval.total_seconds()
        assert body["next_run_at"] - body["decided_at"] >= interval - 5
    finally:
        sidecar.stop()
