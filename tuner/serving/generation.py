"""Completions on the engine thread, seen from asyncio: streamed outputs, text, stop strings.

`Generation` submits one engine job per choice to an `EngineLoop` and yields
each output as the engine thread produces it, timing every token for the
metrics; leaving it early cancels the jobs still running. A job that fails in
the engine (its own request, or the whole step) raises and counts as finished
with reason "error", so every job that started counts under one reason; one
the engine refused at admission never started and counts in none (blocktune's
`rejected` counts it). `ChoiceText` turns one choice's tokens into text
deltas, ends the choice at a stop string and holds back the text that may
still become one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from blocktune.runtime.engine_loop import EngineLoop, EngineStepFailed
from blocktune.runtime.requests import RequestError, RequestFailed, RequestOutput, TokenLogprob
from blocktune.runtime.sampling import SamplingParams
from blocktune.runtime.tokenizer import IncrementalDecoder
from blocktune.tuner.serving.worker_metrics import WorkerMetrics

__all__ = ["ChoiceText", "Generation"]


@dataclass
class _Timing:
    prompt_tokens: int
    max_tokens: int
    last_s: float
    first_s: float = 0.0
    tokens: int = 0
    open: bool = True


class Generation:
    """The engine jobs of one API request (one per prompt and choice) as an async stream."""

    def __init__(
        self,
        loop: EngineLoop,
        jobs: Sequence[tuple[list[int], SamplingParams]],
        metrics: WorkerMetrics,
    ) -> None:
        self._loop = loop
        self._metrics = metrics
        self._queue: asyncio.Queue = asyncio.Queue()
        self.arrival_s = time.monotonic()
        self._timing = [
            _Timing(len(prompt), params.max_tokens, self.arrival_s) for prompt, params in jobs
        ]
        events = asyncio.get_running_loop()

        def emitter(index: int):
            def emit(outcome: RequestOutput | Exception) -> None:
                # Runs on the engine thread; the event loop may be gone at shutdown.
                with contextlib.suppress(RuntimeError):
                    events.call_soon_threadsafe(
                        self._queue.put_nowait, (index, outcome, time.monotonic())
                    )

            return emit

        self._jobs = [
            loop.submit(prompt, params, emitter(i)) for i, (prompt, params) in enumerate(jobs)
        ]

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """`(choice index, output)` until every choice has finished; raises the exception
        that ended a job (a `RequestError` for a request the engine refused, `RequestFailed`
        for one it ended with an error, `EngineStepFailed` for a failed step)."""
        try:
            while any(t.open for t in self._timing):
                index, outcome, at = await self._queue.get()
                timing = self._timing[index]
                if not timing.open:
                    continue
                if isinstance(outcome, RequestOutput) and outcome.finish_reason == "error":
                    outcome = RequestFailed(outcome.error)
                if isinstance(outcome, Exception):
                    self._failed(index, outcome, at)
                    raise outcome
                self._metrics.token(
                    since_s=at - timing.last_s,
                    first=timing.tokens == 0,
                    prompt_tokens=timing.prompt_tokens,
                )
                if timing.tokens == 0:
                    timing.first_s = at
                timing.tokens += 1
                timing.last_s = at
                yield index, outcome
        finally:
            self.cancel()

    def finish(self, index: int, reason: str) -> None:
        """Choice `index` ended with `reason`: record it, and end its job as finished if it
        still runs (the choice met a stop string)."""
        timing = self._timing[index]
        if timing.open:
            self._loop.stop_job(self._jobs[index])
        timing.open = False
        self._record(timing, reason, timing.last_s)

    def _failed(self, index: int, error: Exception, at: float) -> None:
        """Choice `index`'s job ended in the engine with `error`. It counts as "error"
        unless the engine refused it (then it never started); a failed step ended every job
        in flight, so every choice still open counts as "error"."""
        every = isinstance(error, EngineStepFailed)
        for i, (job, timing) in enumerate(zip(self._jobs, self._timing, strict=True)):
            if timing.open and (every or i == index):
                timing.open = False
                if i != index:  # failed too, unless the engine admitted it after that step
                    self._loop.cancel(job)
                if not isinstance(error, RequestError):
                    self._record(timing, "error", at)

    def cancel(self) -> None:
        """Stop every job that still runs (the client went away): each counts as aborted."""
        now = time.monotonic()
        for job, timing in zip(self._jobs, self._timing, strict=True):
            if timing.open:
                timing.open = False
                self._loop.cancel(job)
                self._record(timing, "abort", now)

    def _record(self, timing: _Timing, reason: str, end_s: float) -> None:
        self._metrics.finished(
            reason=reason,
            prompt_tokens=timing.prompt_tokens,
            generation_tokens=timing.tokens,
            latency_s=end_s - self.arrival_s,
            decode_s=timing.last_s - timing.first_s if timing.tokens else 0.0,
            max_tokens=timing.max_tokens,
        )


@dataclass
class ChoiceText:
    """One choice's tokens, text and log-probabilities as its outputs arrive.

    `feed` returns the text that can be sent: with stop strings, the last
    `len(longest) - 1` characters wait until they cannot start one. A choice
    ends at the first stop string, whose text is dropped (`finish_reason`
    "stop"). `prefix` (the echoed prompt) comes first and is never searched.
    Without a decoder (a model with no tokenizer) there is no text.
    """

    decoder: IncrementalDecoder | None
    stop: Sequence[str] = ()
    prefix: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        self.text = self.prefix
        self._sent = 0
        self._hold = max(map(len, self.stop), default=1) - 1

    def feed(self, output: RequestOutput) -> str:
        """Take one output; returns the text to send now (sets `finish_reason` at the end)."""
        self.token_ids.extend(output.new_token_ids)
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = list(output.prompt_logprobs)
        if output.logprob is not None:
            self.logprobs.append(output.logprob)
        if self.decoder is not None:
            self.text += self.decoder.push(output.new_token_ids, final=output.finished)
        if output.finished:
            self.finish_reason = output.finish_reason
        start = max(len(self.prefix), self._sent - self._hold)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.finish_reason = "stop"
        end = len(self.text) if self.finish_reason else len(self.text) - self._hold
        delta = self.text[self._sent : max(end, self._sent)]
        self._sent += len(delta)
        return delta
