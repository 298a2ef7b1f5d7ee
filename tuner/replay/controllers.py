"""Who changes the block size during a replay: the adaptive tuner and the hindsight oracle.

`AdaptiveController` is the sidecar's loop on trace time: finished requests go
into the real `LengthWindow` (capacity `policy.window.capacity`), and the real
`Selector` decides from a snapshot as soon as the window holds
`policy.window.min_samples` requests, then every `policy.interval` after that
first decision. The simulator asks it every `DECISION_TICKS`-th of an interval
(its `interval_s`), so the first decision comes at most that late. An applied
switch is recorded with the selector (so `min_dwell` counts from it) and
charged its modelled swap pause.

`OracleController` follows a schedule fixed in hindsight (the best static size
of each interval, see `replay_objective`) and swaps for free: it bounds what
any tuner could reach.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from blocktune.tuner.config.calibration import Calibration
from blocktune.tuner.config.policy import Policy
from blocktune.tuner.core.selector import Decision, Selector
from blocktune.tuner.sim.window import LengthWindow

__all__ = ["DECISION_TICKS", "AdaptiveController", "OracleController", "TimelinePoint"]

DECISION_TICKS = 30
"""How often per policy interval the adaptive tuner looks whether it is time to decide."""


@dataclass(frozen=True)
class TimelinePoint:
    """One decision: when (trace seconds), the size in force after it and the window's
    median prompt + output length (None while the window is empty)."""

    t_s: float
    block_size: int
    median_len: float | None


class AdaptiveController:
    """LengthWindow + Selector deciding every policy interval of trace time."""

    charges_swaps = True

    def __init__(
        self,
        policy: Policy,
        calibration: Calibration,
        prompt_tokens: np.ndarray,
        output_tokens: np.ndarray,
        groups: list[Hashable | None],
    ) -> None:
        self.decision_interval_s = policy.interval.total_seconds()
        self.interval_s = self.decision_interval_s / DECISION_TICKS
        self.min_samples = policy.window.min_samples
        self.next_decision: int | None = None  # the tick to decide at; None before min_samples
        self.window = LengthWindow(policy.window.capacity, clock=lambda: 0.0)
        self.selector = Selector(policy, calibration, clock=lambda: 0.0)
        self._prompts = prompt_tokens
        self._outputs = output_tokens
        self._groups = groups
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self.timeline: list[TimelinePoint] = []

    def observe(self, requests: np.ndarray, finish_s: np.ndarray) -> None:
        self._pending.append((requests, finish_s))

    def decide(self, now: float, boundary: int, block_size: int) -> int:
        self._flush()
        if self.next_decision is None:
            if len(self.window) < self.min_samples:
                return block_size
        elif boundary < self.next_decision:
            return block_size
        self.next_decision = boundary + DECISION_TICKS
        snapshot = self.window.snapshot()
        _, new_size = self.selector.step(snapshot, block_size, _switch_applied, now=now)
        median = None if snapshot.count == 0 else float(snapshot.total.median)
        self.timeline.append(TimelinePoint(now, new_size, median))
        return new_size

    def _flush(self) -> None:
        """Move the requests finished since the last look into the window."""
        if not self._pending:
            return
        requests = np.concatenate([r for r, _ in self._pending])
        stamps = np.concatenate([s for _, s in self._pending])
        self._pending.clear()
        keep = slice(max(0, len(requests) - self.window.capacity), None)
        requests, stamps = requests[keep], stamps[keep]
        self.window.observe_many(
            self._prompts[requests],
            self._outputs[requests],
            timestamps=stamps,
            prefix_groups=[self._groups[i] for i in requests.tolist()],
        )


def _switch_applied(decision: Decision) -> int:
    """A replayed switch always takes effect (its pause is charged by the simulator)."""
    return decision.block_size


class OracleController:
    """Follows a per-interval schedule of block sizes; swaps cost nothing."""

    charges_swaps = False

    def __init__(self, interval_s: float, schedule: np.ndarray) -> None:
        self.interval_s = interval_s
        self.schedule = schedule

    def observe(self, requests: np.ndarray, finish_s: np.ndarray) -> None:
        """The oracle knows the trace already."""

    def decide(self, now: float, boundary: int, block_size: int) -> int:
        if boundary < len(self.schedule):
            return int(self.schedule[boundary])
        return block_size
