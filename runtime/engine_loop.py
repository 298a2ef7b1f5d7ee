"""The thread that owns an engine: thread-safe submit, cancel, swap and state.

`EngineLoop` runs the engine's steps on one thread; callers (the HTTP worker,
tests, tools) hand it completions, cancellations and block-size requests and
get every step's output through a callback, so concurrent requests share the
engine through continuous batching and can stream. After each step (and each
batch of new requests or cancellations) the thread publishes a snapshot of
the engine's state, which `state()` returns at once, however long the step in
progress takes. It imports only the runtime.

Requests that reach an idle engine usually come as a burst (clients starting
together, or a wave of them after the last batch finished), a few hundred
microseconds to a few milliseconds apart as the HTTP layer prepares them. A
step started at the first arrival would prefill that request alone, and the rest
of the burst would wait for that step before theirs; so an idle engine's first
step can wait until `gather_s` passes with no new request (at most
`GATHER_LIMIT_S`) and prefill the burst together. A busy engine admits new
requests at its next step boundary. The default (`DEFAULT_GATHER_S`, 0) starts
at once: see there for what gathering costs as well as what it buys.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from blocktune.runtime.defaults import DEFAULT_GATHER_S, GATHER_LIMIT_S
from blocktune.runtime.engine import Engine
from blocktune.runtime.requests import RequestError, RequestOutput
from blocktune.runtime.sampling import SamplingParams
from blocktune.runtime.swap_result import SwapResult

__all__ = ["EngineLoop", "EngineStepFailed", "Job"]

log = logging.getLogger("blocktune.engine_loop")


@dataclass
class Job:
    """A completion handed to the engine thread. `emit` is called on that thread with each
    of its outputs (the last one `finished`), or once with the exception that ended it."""

    prompt: list[int]
    params: SamplingParams
    emit: Callable[[RequestOutput | Exception], None]
    request_id: int | None = None


class EngineStepFailed(RuntimeError):
    """The engine raised during a step; the requests in flight were dropped."""


@dataclass
class _Counters:
    failed_steps: int = 0
    completed: int = 0
    cancelled: int = 0
    rejected: int = 0


class EngineLoop:
    """Runs the engine's steps on one thread; thread-safe submit, cancel, swap and state."""

    def __init__(
        self, engine: Engine, idle_wait_s: float = 0.02, gather_s: float = DEFAULT_GATHER_S
    ) -> None:
        if gather_s < 0:
            raise ValueError(f"gather_s must be at least 0, got {gather_s}")
        self.engine = engine
        self._inbox: queue.SimpleQueue[Job | tuple[str, object]] = queue.SimpleQueue()
        self._jobs: dict[int, Job] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._idle_wait_s = idle_wait_s
        self._gather_s = gather_s
        self.counters = _Counters()
        self._published = threading.Condition()
        self._snapshot = self._take_snapshot()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    @property
    def running(self) -> bool:
        """Whether the engine thread is serving (started and not stopped)."""
        return self._thread.is_alive() and not self._stop.is_set()

    def submit(self, prompt: list[int], params: SamplingParams, emit) -> Job:
        """Queue a completion; `emit` gets its outputs (see `Job`)."""
        job = Job(prompt, params, emit)
        self._inbox.put(job)
        self._wake.set()
        return job

    def cancel(self, job: Job) -> None:
        """Drop a job that has not finished (its client left)."""
        self._inbox.put(("cancel", job))
        self._wake.set()

    def stop_job(self, job: Job) -> None:
        """End a job early as finished, not cancelled (its choice met a stop string)."""
        self._inbox.put(("stop", job))
        self._wake.set()

    def request_block_size(self, block_size: int):
        ticket = self.engine.request_block_size(block_size)
        self._wake.set()
        return ticket

    def swap(self, block_size: int, timeout_s: float) -> SwapResult:
        """Swap the block size at the next step boundary; the result once `state()` shows it.

        Raises `TimeoutError` when no step boundary comes within `timeout_s`, and what the
        commit raised when it failed.
        """
        result = self.request_block_size(block_size).result(timeout_s)
        steps = self.engine.steps  # the step that swapped, or a later one
        with self._published:
            self._published.wait_for(lambda: self._snapshot["steps"] >= steps, timeout_s)
        return result

    def state(self) -> dict:
        """The engine's state as published after its last step, and the loop's counters
        now: never waits for a step."""
        with self._published:
            snapshot = self._snapshot
        return {
            **snapshot,
            "completed": self.counters.completed,
            "cancelled": self.counters.cancelled,
            "rejected": self.counters.rejected,
            "failed_steps": self.counters.failed_steps,
            "swap_history": list(snapshot["swap_history"]),
        }

    def _take_snapshot(self) -> dict:
        """The engine's state now (on the engine's thread, or while it is not running)."""
        with self._lock:
            stats = self.engine.stats()
            history = [r.to_dict() for r in self.engine.swap_history]
        return {**stats, "swap_history": history}

    def _publish(self) -> None:
        snapshot = self._take_snapshot()
        with self._published:
            self._snapshot = snapshot
            self._published.notify_all()

    def check(self) -> None:
        """Assert the engine's bookkeeping invariants (between steps)."""
        with self._lock:
            self.engine.blocks.check()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while not self._stop.is_set():
            if self._drain_inbox():
                self._publish()
            with self._lock:
                busy = self.engine.has_unfinished() or self.engine.has_pending_swaps()
                if busy:
                    outputs = self._step()
            if not busy:
                if self._wake.wait(self._idle_wait_s):
                    self._wake.clear()
                    self._gather()
                continue
            for output in outputs:
                job = self._jobs.get(output.request_id)
                if job is None:
                    continue
                if output.finished:
                    del self._jobs[output.request_id]
                    self.counters.completed += 1
                job.emit(output)
            self._publish()

    def _gather(self) -> None:
        """Wait while requests keep arriving `gather_s` apart (at most `GATHER_LIMIT_S`),
        so that the first step after an idle spell prefills the whole burst."""
        deadline = time.monotonic() + GATHER_LIMIT_S
        while self._gather_s and time.monotonic() < deadline:
            if not self._wake.wait(min(self._gather_s, deadline - time.monotonic())):
                return
            self._wake.clear()

    def _step(self) -> list[RequestOutput]:
        """One engine step (lock held). A step that raises fails every request in flight,
        so nobody waits forever, and the loop keeps serving new ones."""
        try:
            outputs = self.engine.step()
        except Exception as error:
            log.exception("engine step failed; failing the %d requests in flight", len(self._jobs))
            failure = EngineStepFailed(f"engine step failed: {type(error).__name__}: {error}")
            for request_id, job in list(self._jobs.items()):
                with contextlib.suppress(Exception):
                    self.engine.cancel(request_id)
                job.emit(failure)
            self._jobs.clear()
            self.counters.failed_steps += 1
            outputs = []
        return outputs

    def _drain_inbox(self) -> int:
        """Admit the new jobs and apply the cancellations; how many items there were."""
        count = 0
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return count
            count += 1
            if isinstance(item, Job):
                try:
                    with self._lock:
                        item.request_id = self.engine.add_request(item.prompt, item.params)
                except RequestError as error:
                    self.counters.rejected += 1
                    item.emit(error)
                    continue
                self._jobs[item.request_id] = item
            else:
                action, job = item
                if job.request_id is None or not self._jobs.pop(job.request_id, None):
                    continue
                with self._lock:
                    if action == "stop":
                        self.engine.stop(job.request_id)
                    else:
                        self.engine.cancel(job.request_id)
                if action == "stop":
                    self.counters.completed += 1
                else:
                    self.counters.cancelled += 1
