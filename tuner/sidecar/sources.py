"""Where the sidecar's request lengths come from: validated observations and polled sources.

Every source ends in the same place: an `Observations` batch handed to the
sidecar's sink, which writes it to the length window in one call.

- push: `POST /v1/observations` bodies go through `parse_observations` (a JSON
  list, or `{"observations": [...]}`, of at most `MAX_OBSERVATIONS` items); one
  invalid item rejects the whole batch, so nothing is ever partially applied.
- polled sources (`vllm_metrics`, `jsonl_log`) are `PollingSource`s that a
  `SourceRunner` calls every interval on an APScheduler scheduler; a poll that
  raises is logged and counted, and the next one still runs.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated

import numpy as np
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.interval import IntervalTrigger
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, TypeAdapter
from pydantic import ValidationError as PydanticValidationError

from blocktune.traces.schema import MAX_TOKENS
from blocktune.tuner.config.config_files import format_location
from blocktune.tuner.operations import log_event

__all__ = [
    "MAX_OBSERVATIONS",
    "MAX_TOKENS",
    "InvalidObservations",
    "Observation",
    "Observations",
    "PollingSource",
    "SourceRunner",
    "SourceStatus",
    "TooManyObservations",
    "parse_observations",
]

MAX_OBSERVATIONS = 10_000
MAX_PREFIX_GROUP = 256
MAX_REPORTED_ERRORS = 20
log = logging.getLogger("blocktune.sidecar")


class Observation(BaseModel):
    """One finished request: its prompt and output lengths, when it finished, its prefix group."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt_tokens: Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS)]
    output_tokens: Annotated[StrictInt, Field(ge=0, le=MAX_TOKENS)]
    timestamp: Annotated[StrictFloat, Field(allow_inf_nan=False)] | None = Field(
        default=None, description="Unix time in seconds; default: when it arrives"
    )
    prefix_group: Annotated[str, Field(max_length=MAX_PREFIX_GROUP)] | None = None


OBSERVATION_LIST = TypeAdapter(list[Observation])


class InvalidObservations(ValueError):
    """A batch of observations that cannot be applied; `errors` names each item and field."""

    def __init__(self, message: str, errors: Sequence[dict] = ()) -> None:
        super().__init__(message)
        self.errors = list(errors)


class TooManyObservations(InvalidObservations):
    """A batch longer than the per-call limit."""


@dataclass(frozen=True)
class Observations:
    """A validated batch in the length window's `observe_many` form."""

    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    timestamps: np.ndarray | None = None
    prefix_groups: list[str | None] | None = None

    def __len__(self) -> int:
        return len(self.prompt_tokens)

    @classmethod
    def of(cls, items: Sequence[Observation], *, now: float) -> Observations:
        """Columns of `items`; a missing timestamp becomes `now`."""
        prompts = np.fromiter((o.prompt_tokens for o in items), np.int64, len(items))
        outputs = np.fromiter((o.output_tokens for o in items), np.int64, len(items))
        stamps = np.fromiter(
            (now if o.timestamp is None else o.timestamp for o in items), np.float64, len(items)
        )
        groups = [o.prefix_group for o in items]
        has_groups = any(g is not None for g in groups)
        return cls(prompts, outputs, stamps, groups if has_groups else None)


def parse_observations(
    payload: object, *, now: float, limit: int = MAX_OBSERVATIONS
) -> Observations:
    """Validate a decoded JSON body: a list of observations or `{"observations": [...]}`.

    Raises `TooManyObservations` over `limit` items and `InvalidObservations`
    naming the index and field of each bad item (the first `MAX_REPORTED_ERRORS`).
    """
    if isinstance(payload, dict) and set(payload) == {"observations"}:
        payload = payload["observations"]
    if not isinstance(payload, list):
        raise InvalidObservations(
            'expected a JSON list of observations or {"observations": [...]}, '
            f"got {_json_kind(payload)}"
        )
    if len(payload) > limit:
        raise TooManyObservations(
            f"{len(payload)} observations in one call; the limit is {limit} per call"
        )
    try:
        items = OBSERVATION_LIST.validate_python(payload)
    except PydanticValidationError as exc:
        errors = [_item_error(e) for e in exc.errors()[:MAX_REPORTED_ERRORS]]
        first = errors[0]
        raise InvalidObservations(
            f"{exc.error_count()} invalid field(s), nothing was applied; first: "
            f"observations[{first['index']}].{first['field']}: {first['message']}",
            errors,
        ) from None
    return Observations.of(items, now=now)


def _item_error(error: dict) -> dict:
    loc = error["loc"]
    index = loc[0] if loc and isinstance(loc[0], int) else None
    field = format_location(loc[1:]) if len(loc) > 1 else "(item)"
    message = error["msg"]
    value = error.get("input")
    if error["type"] != "missing" and isinstance(value, int | float | bool | str | None):
        message += f" (got {json.dumps(value)[:80]})"
    return {"index": index, "field": field, "message": message}


def _json_kind(value: object) -> str:
    names = {dict: "an object", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


class SourceStatus:
    """Thread-safe counters of one source: polls, failures, bad items (the oversized among
    them apart too), samples, last outcome."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self.polls = 0
        self.errors = 0
        self.samples = 0
        self.unobserved_polls = 0
        self.oversized_lines = 0
        self.last_ok: bool | None = None
        self.last_error: str | None = None
        self.last_poll_at: float | None = None

    def succeeded(self, samples: int) -> None:
        with self._lock:
            self.polls += 1
            self.samples += samples
            self.last_ok = True
            self.last_poll_at = time.time()

    def failed(self, error: str) -> None:
        with self._lock:
            self.polls += 1
            self.errors += 1
            self.last_ok = False
            self.last_error = error
            self.last_poll_at = time.time()

    def bad_items(self, count: int, error: str) -> None:
        """Items skipped inside an otherwise successful poll (bad lines, rejected batches)."""
        with self._lock:
            self.errors += count
            self.last_error = error

    def oversized(self, error: str) -> None:
        """A line over the bytes a source reads, skipped unread (a bad item)."""
        with self._lock:
            self.errors += 1
            self.oversized_lines += 1
            self.last_error = error

    def unobserved(self) -> None:
        """A poll that saw requests finish on the server but yielded no observation."""
        with self._lock:
            self.unobserved_polls += 1

    def to_dict(self) -> dict:
        with self._lock:
            return {
                "source": self.name,
                "polls": self.polls,
                "errors": self.errors,
                "samples": self.samples,
                "unobserved_polls": self.unobserved_polls,
                "oversized_lines": self.oversized_lines,
                "last_ok": self.last_ok,
                "last_error": self.last_error,
                "last_poll_at": self.last_poll_at,
            }


Sink = Callable[[Observations], None]


class PollingSource(ABC):
    """A source read every `interval_s`: `poll()` hands new observations to the sink."""

    name: str
    interval_s: float

    def __init__(self) -> None:
        self.status = SourceStatus(self.name)

    @abstractmethod
    def poll(self) -> int:
        """Read what is new, hand it to the sink; the number of observations (raise on failure)."""

    @abstractmethod
    def close(self) -> None:
        """Release the source's files and connections."""


class SourceRunner:
    """Polls each source every its interval on one background scheduler (first poll at once)."""

    def __init__(self, sources: Sequence[PollingSource]) -> None:
        self.sources = list(sources)
        self._scheduler: BackgroundScheduler | None = None

    @property
    def running(self) -> bool:
        return self._scheduler is not None and self._scheduler.running

    def start(self) -> None:
        if self.running or not self.sources:
            return
        scheduler = BackgroundScheduler(daemon=True)
        for source in self.sources:
            scheduler.add_job(
                self.poll,
                IntervalTrigger(seconds=source.interval_s),
                args=[source],
                id=f"blocktune-source-{source.name}",
                coalesce=True,
                max_instances=1,
                next_run_time=datetime.now().astimezone(),
            )
        scheduler.start()
        self._scheduler = scheduler

    def stop(self) -> None:
        if self._scheduler is not None and self._scheduler.running:
            self._scheduler.shutdown(wait=True)
        self._scheduler = None
        for source in self.sources:
            source.close()

    @staticmethod
    def poll(source: PollingSource) -> None:
        """One poll, with its outcome counted; exceptions never escape."""
        try:
            samples = source.poll()
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            source.status.failed(error)
            log_event(log, "source_poll_failed", source=source.name, error=error)
            return
        source.status.succeeded(samples)
