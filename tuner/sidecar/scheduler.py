"""Every `policy.interval`, snapshot the length window and ask the selector for a decision.

The job runs on an APScheduler `BackgroundScheduler` with an `IntervalTrigger`
under a stable job id, `coalesce=True` (missed runs collapse into one) and
`max_instances=1` (never two runs at once). A failing run (selector or
callback) is logged and counted; the scheduler keeps going. A decision with
`switch=True` becomes the collector's current block size once `on_decision`
returns without raising (the callback is where an actuator applies it); only
then does the selector's `min_dwell` start counting from it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from apscheduler.job import Job
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.interval import IntervalTrigger

from blocktune.tuner.core.policy import Policy
from blocktune.tuner.core.selector import Decision, Selector
from blocktune.tuner.core.window import LengthWindow

__all__ = ["JOB_ID", "Collector"]

JOB_ID = "blocktune-collector"
log = logging.getLogger(__name__)


class Collector:
    """Runs window snapshot -> selector -> `on_decision` every policy interval."""

    def __init__(
        self,
        window: LengthWindow,
        selector: Selector,
        on_decision: Callable[[Decision], None],
        policy: Policy,
        *,
        block_size: int,
    ) -> None:
        self.window = window
        self.selector = selector
        self.on_decision = on_decision
        self.policy = policy
        self._block_size = block_size
        self._run_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._runs = 0
        self._failures = 0
        self._last_decision: Decision | None = None
        self._last_error: str | None = None
        self._scheduler: BackgroundScheduler | None = None

    @property
    def block_size(self) -> int:
        """The block size the collector believes is in force."""
        with self._stats_lock:
            return self._block_size

    @property
    def runs(self) -> int:
        """Runs that produced a decision and delivered it."""
        with self._stats_lock:
            return self._runs

    @property
    def failures(self) -> int:
        """Runs that raised (logged, counted, and otherwise ignored)."""
        with self._stats_lock:
            return self._failures

    @property
    def last_decision(self) -> Decision | None:
        with self._stats_lock:
            return self._last_decision

    @property
    def last_error(self) -> str | None:
        with self._stats_lock:
            return self._last_error

    @property
    def job(self) -> Job | None:
        """The scheduled APScheduler job while started, else None."""
        return None if self._scheduler is None else self._scheduler.get_job(JOB_ID)

    @property
    def running(self) -> bool:
        return self._scheduler is not None and self._scheduler.running

    def start(self) -> None:
        """Schedule the job every `policy.interval` (first run one interval from now)."""
        if self.running:
            return
        scheduler = BackgroundScheduler(daemon=True)
        scheduler.add_job(
            self._job,
            IntervalTrigger(seconds=self.policy.interval.total_seconds()),
            id=JOB_ID,
            name="blocktune window -> selector",
            coalesce=True,
            max_instances=1,
            replace_existing=True,
        )
        scheduler.start()
        self._scheduler = scheduler

    def stop(self, *, wait: bool = True) -> None:
        """Stop scheduling; with `wait`, let a run in progress finish first."""
        if self._scheduler is not None and self._scheduler.running:
            self._scheduler.shutdown(wait=wait)
        self._scheduler = None

    def run_now(self) -> Decision | None:
        """One run in the caller's thread; the decision, or None when the run failed."""
        return self._job()

    def _job(self) -> Decision | None:
        with self._run_lock:
            try:
                decision = self.selector.decide(self.window.snapshot(), self.block_size)
                self.on_decision(decision)
                self.selector.record_switch(decision)
            except Exception as exc:
                log.exception("block-size decision run failed")
                with self._stats_lock:
                    self._failures += 1
                    self._last_error = f"{type(exc).__name__}: {exc}"
                return None
            with self._stats_lock:
                self._runs += 1
                self._last_decision = decision
                if decision.switch:
                    self._block_size = decision.block_size
            return decision
