"""The length window: the most recent finished requests, in a fixed-size ring buffer.

`LengthWindow.observe()` writes one request in O(1) under a lock, so engine
threads can report finished requests while the decision scheduler takes snapshots.
Memory is `capacity` rows whatever the load: the oldest request is overwritten.

A request's prefix group (any hashable, or None) is stored as a 63-bit key:
integers as themselves, anything else by a BLAKE2 digest of its text, so keys
are the same in every process.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "InvalidWindowInput",
    "LengthSummary",
    "LengthWindow",
    "WindowSnapshot",
    "histogram_edges",
]

BINS_PER_OCTAVE = 4
MAX_LENGTH_OCTAVES = 21  # histogram edges up to 2**21 tokens


class InvalidWindowInput(ValueError):
    """A request that cannot be observed: the message names the bad value."""


def histogram_edges(
    bins_per_octave: int = BINS_PER_OCTAVE, octaves: int = MAX_LENGTH_OCTAVES
) -> np.ndarray:
    """Log-spaced token-length bin edges from 1 to 2**octaves (the same for every snapshot)."""
    return np.logspace(0, octaves, octaves * bins_per_octave + 1, base=2.0)


def prefix_key(group: Hashable) -> int:
    """A stable 63-bit integer key for a prefix group."""
    if isinstance(group, int | np.integer) and not isinstance(group, bool):
        return int(group)
    digest = hashlib.blake2b(str(group).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(frozen=True)
class LengthSummary:
    """Count, mean and percentiles of one length column, in tokens."""

    count: int
    mean: float
    median: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: np.ndarray) -> LengthSummary:
        if len(values) == 0:
            return cls(0, float("nan"), float("nan"), float("nan"), float("nan"))
        median, p90, p99 = np.percentile(values, [50, 90, 99])
        return cls(len(values), float(values.mean()), float(median), float(p90), float(p99))


@dataclass(frozen=True)
class WindowSnapshot:
    """A copy of the window, oldest request first, with summary statistics.

    `total` summarises prompt + output tokens per request; `histogram_counts[i]`
    counts totals in `[histogram_edges[i], histogram_edges[i+1])`.
    """

    timestamps: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    prefix_keys: np.ndarray
    has_prefix: np.ndarray
    observed_total: int
    prompt: LengthSummary
    output: LengthSummary
    total: LengthSummary
    histogram_edges: np.ndarray
    histogram_counts: np.ndarray

    @property
    def count(self) -> int:
        return len(self.prompt_tokens)

    @property
    def shared_prefixes(self) -> int:
        """Requests that could reuse a prefix computed by an earlier request of their group."""
        keys = self.prefix_keys[self.has_prefix]
        return int(len(keys) - len(np.unique(keys)))

    def generated_tokens_per_s(self) -> float | None:
        """Output tokens per second over the window's time span (None below two timestamps).

        From 20 requests on, the span runs between the 5th and 95th percentile
        timestamps, counting the tokens of the requests inside it, so one stray
        timestamp (a client clock at 0, a replayed old line) cannot stretch it.
        """
        if self.count < 2:
            return None
        trim = [5, 95] if self.count >= 20 else [0, 100]
        low, high = np.percentile(self.timestamps, trim)
        inside = (self.timestamps >= low) & (self.timestamps <= high)
        span = float(high - low)
        return float(self.output_tokens[inside].sum()) / span if span > 0 else None

    def summary(self) -> dict:
        """Plain numbers for JSON: counts, length summaries and the non-empty histogram bins."""
        nonzero = np.flatnonzero(self.histogram_counts)
        return {
            "count": self.count,
            "observed_total": self.observed_total,
            "prompt_tokens": vars(self.prompt),
            "output_tokens": vars(self.output),
            "total_tokens": vars(self.total),
            "histogram": [
                {
                    "from_tokens": float(self.histogram_edges[i]),
                    "to_tokens": float(self.histogram_edges[i + 1]),
                    "count": int(self.histogram_counts[i]),
                }
                for i in nonzero
            ],
        }


class LengthWindow:
    """A thread-safe ring buffer of the last `capacity` finished requests."""

    def __init__(self, capacity: int = 1000, *, clock: Callable[[], float] = time.time) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise InvalidWindowInput(f"capacity must be a positive integer, got {capacity!r}")
        self._capacity = capacity
        self._clock = clock
        self._lock = threading.Lock()
        self._timestamps = np.zeros(capacity, dtype=np.float64)
        self._prompts = np.zeros(capacity, dtype=np.int64)
        self._outputs = np.zeros(capacity, dtype=np.int64)
        self._prefix = np.zeros(capacity, dtype=np.int64)
        self._has_prefix = np.zeros(capacity, dtype=bool)
        self._next = 0
        self._size = 0
        self._observed = 0
        self._edges = histogram_edges()

    @property
    def capacity(self) -> int:
        return self._capacity

    def __len__(self) -> int:
        with self._lock:
            return self._size

    def observe(
        self,
        prompt_tokens: int,
        output_tokens: int,
        *,
        timestamp: float | None = None,
        prefix_group: Hashable | None = None,
    ) -> None:
        """Record one finished request (prompt >= 1 token, output >= 0 tokens)."""
        prompt, output = _check_lengths(prompt_tokens, output_tokens)
        now = self._clock() if timestamp is None else float(timestamp)
        key = 0 if prefix_group is None else prefix_key(prefix_group)
        with self._lock:
            i = self._next
            self._timestamps[i] = now
            self._prompts[i] = prompt
            self._outputs[i] = output
            self._prefix[i] = key
            self._has_prefix[i] = prefix_group is not None
            self._advance(1)

    def observe_many(
        self,
        prompt_tokens: Sequence[int] | np.ndarray,
        output_tokens: Sequence[int] | np.ndarray,
        *,
        timestamps: Sequence[float] | np.ndarray | None = None,
        prefix_groups: Sequence[Hashable | None] | None = None,
        earlier: int = 0,
    ) -> None:
        """Record many finished requests in order (only the last `capacity` are kept).

        `earlier` counts requests observed before these that the window no longer
        holds (a restored lifetime total) in `observed_total`.
        """
        if earlier < 0:
            raise InvalidWindowInput(f"earlier must be >= 0, got {earlier}")
        prompts = np.asarray(prompt_tokens)
        outputs = np.asarray(output_tokens)
        n = len(prompts)
        if prompts.ndim != 1 or outputs.shape != prompts.shape:
            raise InvalidWindowInput(
                f"prompt_tokens and output_tokens must be 1-D of one length, got shapes "
                f"{prompts.shape} and {outputs.shape}"
            )
        if n and not (np.issubdtype(prompts.dtype, np.integer) and prompts.min() >= 1):
            raise InvalidWindowInput("prompt_tokens must be integers >= 1")
        if n and not (np.issubdtype(outputs.dtype, np.integer) and outputs.min() >= 0):
            raise InvalidWindowInput("output_tokens must be integers >= 0")
        if timestamps is None:
            stamps = np.full(n, self._clock(), dtype=np.float64)
        else:
            stamps = np.asarray(timestamps, dtype=np.float64)
            if stamps.shape != prompts.shape:
                raise InvalidWindowInput(
                    f"timestamps has shape {stamps.shape}, expected {prompts.shape}"
                )
        if prefix_groups is None:
            keys, has = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=bool)
        else:
            if len(prefix_groups) != n:
                raise InvalidWindowInput(
                    f"prefix_groups has {len(prefix_groups)} entries, expected {n}"
                )
            has = np.array([g is not None for g in prefix_groups], dtype=bool)
            keys = np.array(
                [0 if g is None else prefix_key(g) for g in prefix_groups], dtype=np.int64
            )
        keep = slice(max(0, n - self._capacity), n)
        rows = (prompts[keep], outputs[keep], stamps[keep], keys[keep], has[keep])
        with self._lock:
            m = len(rows[0])
            index = (self._next + np.arange(m)) % self._capacity
            self._prompts[index], self._outputs[index], self._timestamps[index] = rows[:3]
            self._prefix[index], self._has_prefix[index] = rows[3:]
            self._advance(m)
            self._observed += n - m + earlier

    def snapshot(self) -> WindowSnapshot:
        """A consistent copy of the window (oldest first) with its statistics."""
        with self._lock:
            start = (self._next - self._size) % self._capacity
            order = (start + np.arange(self._size)) % self._capacity
            timestamps = self._timestamps[order]
            prompts = self._prompts[order]
            outputs = self._outputs[order]
            keys = self._prefix[order]
            has = self._has_prefix[order]
            observed = self._observed
        totals = prompts + outputs
        counts, _ = np.histogram(totals, bins=self._edges)
        return WindowSnapshot(
            timestamps=timestamps,
            prompt_tokens=prompts,
            output_tokens=outputs,
            prefix_keys=keys,
            has_prefix=has,
            observed_total=observed,
            prompt=LengthSummary.of(prompts),
            output=LengthSummary.of(outputs),
            total=LengthSummary.of(totals),
            histogram_edges=self._edges,
            histogram_counts=counts,
        )

    def _advance(self, count: int) -> None:
        self._next = (self._next + count) % self._capacity
        self._size = min(self._capacity, self._size + count)
        self._observed += count


def _check_lengths(prompt_tokens: object, output_tokens: object) -> tuple[int, int]:
    for name, value, low in (
        ("prompt_tokens", prompt_tokens, 1),
        ("output_tokens", output_tokens, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
            raise InvalidWindowInput(f"{name} must be an integer >= {low}, got {value!r}")
    return int(prompt_tokens), int(output_tokens)
