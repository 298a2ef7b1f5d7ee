"""Run the sidecar's decision every `policy.interval` on an APScheduler background thread.

The job runs on a `BackgroundScheduler` with an `IntervalTrigger` under a
stable job id, `coalesce=True` (missed runs collapse into one) and
`max_instances=1` (never two runs at once). A failing run is logged and
counted; the scheduler keeps going. What a run does (snapshot, decide, apply,
record) belongs to the caller's `run` function; the scheduler only times it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Generic, TypeVar

from apscheduler.job import Job
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.interval import IntervalTrigger

__all__ = ["JOB_ID", "DecisionScheduler"]

JOB_ID = "blocktune-decision"
log = logging.getLogger(__name__)

R = TypeVar("R")


class DecisionScheduler(Generic[R]):
    """Calls `run` every `interval` (and on `run_now`), one run at a time, counting failures."""

    def __init__(self, run: Callable[[], R], interval: timedelta) -> None:
        self._run = run
        self._interval_s = interval.total_seconds()
        self._run_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._runs = 0
        self._failures = 0
        self._last_error: str | None = None
        self._scheduler: BackgroundScheduler | None = None

    @property
    def runs(self) -> int:
        """Runs that completed without raising."""
        with self._stats_lock:
            return self._runs

    @property
    def failures(self) -> int:
        """Runs that raised (logged, counted, and otherwise ignored)."""
        with self._stats_lock:
            return self._failures

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
        """Schedule the run every interval (the first one interval from now)."""
        if self.running:
            return
        scheduler = BackgroundScheduler(daemon=True)
        scheduler.add_job(
            self.run_now,
            IntervalTrigger(seconds=self._interval_s),
            id=JOB_ID,
            name="blocktune decision",
            coalesce=True,
            max_instances=1,
            replace_existing=True,
        )
        scheduler.start()
        self._scheduler = scheduler

    def run_soon(self) -> None:
        """Run once now on the scheduler's thread, then every interval from now (the first
        decision as soon as there is enough to decide on); nothing when not started."""
        if not self.running:
            return
        # The interval trigger counts its next run from this one's time.
        self._scheduler.modify_job(JOB_ID, next_run_time=datetime.now(UTC))

    def stop(self, *, wait: bool = True) -> None:
        """Stop scheduling; with `wait`, let a run in progress finish first."""
        if self._scheduler is not None and self._scheduler.running:
            self._scheduler.shutdown(wait=wait)
        self._scheduler = None

    def run_now(self) -> R | None:
        """One run in the caller's thread: its result, or None when it raised."""
        with self._run_lock:
            try:
                result = self._run()
            except Exception as exc:
                log.exception("block-size decision run failed")
                with self._stats_lock:
                    self._failures += 1
                    self._last_error = f"{type(exc).__name__}: {exc}"
                return None
            with self._stats_lock:
                self._runs += 1
            return result
