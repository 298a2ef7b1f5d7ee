"""The sidecar's numbers: what it counts as it runs, and what its metrics read.

The `Sidecar` keeps one `SidecarStats` and counts into it (under its lock):
observations, decisions, swaps, measured restarts, engine mismatches, failed
state saves. `Sidecar.stats()` hands out a copy with the readings of that
moment filled in beside the counts: the block sizes, the switch cost, the
last decision's padding, the window's requests, the scheduler's failures and
the sources' errors. The Prometheus collector of `blocktune.tuner.serving.sidecar_app`
reads nothing else.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

__all__ = ["MISMATCH_KINDS", "RESTARTS_KEPT", "SidecarStats"]

RESTARTS_KEPT = 5
"""Measured restarts whose median replaces the policy's `restart` cost."""
MISMATCH_KINDS = ("block_size", "backend", "device")
"""What an engine's report can disagree with the policy about."""


@dataclass
class SidecarStats:
    """The sidecar's counts and, in a copy from `Sidecar.stats()`, its readings."""

    observations: int = 0
    decisions: dict[str, int] = field(default_factory=lambda: {"true": 0, "false": 0})
    """Decisions by whether they switch ("true", "false")."""
    swaps: dict[str, int] | None = None
    """Swaps asked of the actuator by status; None without an actuator."""
    restarts_s: deque[float] = field(default_factory=lambda: deque(maxlen=RESTARTS_KEPT))
    """The last measured restarts, oldest first."""
    engine_mismatches: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(MISMATCH_KINDS, 0)
    )
    state_save_failures: int = 0
    # The readings, set in the copy `Sidecar.stats()` hands out:
    current_block_size: int = 0
    recommended_block_size: int | None = None
    switch_cost_s: float = 0.0
    padding_ratio: dict[int, float] = field(default_factory=dict)
    """The last decision's padding share at each candidate block size."""
    window_requests: int = 0
    decision_failures: int = 0
    source_errors: dict[str, int] = field(default_factory=dict)
    source_unobserved_polls: dict[str, int] = field(default_factory=dict)

    def copy(self, **readings: object) -> SidecarStats:
        """A copy that shares no container with this record, with `readings` set."""
        copied = {
            "decisions": dict(self.decisions),
            "swaps": None if self.swaps is None else dict(self.swaps),
            "restarts_s": deque(self.restarts_s, maxlen=self.restarts_s.maxlen),
            "engine_mismatches": dict(self.engine_mismatches),
            "padding_ratio": dict(self.padding_ratio),
            "source_errors": dict(self.source_errors),
            "source_unobserved_polls": dict(self.source_unobserved_polls),
        }
        return replace(self, **{**copied, **readings})
