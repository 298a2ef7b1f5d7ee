"""Request lengths from a vLLM server's Prometheus `/metrics`.

vLLM reports lengths only as histograms, `vllm:request_prompt_tokens` and
`vllm:request_generation_tokens` (`_bucket{le}`, `_sum`, `_count`), one series
per label set (`engine`, `model_name`, ...), and its block size as a label of
`vllm:cache_config_info{block_size="16"}`. Each scrape is parsed with
prometheus_client's text parser and turned into length samples:

1. Per label set, the bucket counts since the previous scrape (the delta of
   the cumulative counts). The first scrape is only a baseline: it holds the
   server's whole history, not recent traffic. A label set seen for the first
   time later contributes all its counts; a count that went down, or changed
   bucket bounds, is a counter reset (a restarted vLLM), so everything in the
   new series is new. A series missing from one scrape keeps its last value.
2. Each bucket's n new requests become n integer lengths spread evenly over
   the bucket's integers (lo, hi]; requests in the `+Inf` bucket are placed at
   the length that makes the `_sum` delta come out right, and the finite
   buckets are then shifted toward their upper or lower edges, never out of
   their bucket, until the total equals the `_sum` delta (within rounding).
   Every sample stays inside its bucket, so re-bucketing the samples gives
   back exactly the histogram's counts.
3. vLLM records both histograms per finished request but not which prompt
   went with which output, so the samples are paired by a seeded random
   permutation: the prompt and output of a request are taken as independent,
   the coupling that assumes nothing more than the two distributions. When
   one histogram is ahead of the other at a scrape, the unpaired samples wait
   (bounded) for the next scrape.
4. The pairs get timestamps spread evenly over the time since the previous
   scrape, so the window's token rate is the server's.

vLLM also counts finished requests, `vllm:request_success_total` by reason. A
scrape where that count grew but no observation came out (the histograms are
missing, named otherwise, or did not move) is logged as a warning
(`vllm_requests_without_lengths`) and counted in the source's status, so a
server that does not export what the window needs is never silently ignored.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from blocktune.tuner.config.policy import VllmMetricsSettings
from blocktune.tuner.operations import log_event
from blocktune.tuner.sidecar.sources import MAX_TOKENS, Observations, PollingSource, Sink

__all__ = [
    "CACHE_INFO",
    "FINISHED",
    "GENERATION",
    "PROMPT",
    "Histogram",
    "HistogramTracker",
    "VllmMetricsSource",
    "parse_exposition",
    "spread_samples",
]

PROMPT = "vllm:request_prompt_tokens"
GENERATION = "vllm:request_generation_tokens"
CACHE_INFO = "vllm:cache_config_info"
FINISHED = "vllm:request_success_total"
MAX_PENDING = 100_000
log = logging.getLogger("blocktune.sidecar")

LabelKey = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Histogram:
    """One series of a Prometheus histogram: upper bounds, cumulative counts, sum and count."""

    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]
    sum: float
    count: float

    def bucket_counts(self) -> np.ndarray:
        """Requests per bucket (not cumulative), as integers."""
        return np.diff(np.asarray(self.cumulative), prepend=0.0).round().astype(np.int64)

    def since(self, earlier: Histogram | None) -> Histogram:
        """The requests added after `earlier`; all of them after a reset or for a new series."""
        if earlier is None or earlier.bounds != self.bounds or self.count < earlier.count:
            return self
        if any(
            now < before for now, before in zip(self.cumulative, earlier.cumulative, strict=True)
        ):
            return self
        return Histogram(
            self.bounds,
            tuple(n - b for n, b in zip(self.cumulative, earlier.cumulative, strict=True)),
            self.sum - earlier.sum,
            self.count - earlier.count,
        )


@dataclass(frozen=True)
class Exposition:
    """What one scrape holds: both histograms per label set, the block sizes reported and
    the finished requests counted (None without `vllm:request_success_total`)."""

    prompt: dict[LabelKey, Histogram]
    generation: dict[LabelKey, Histogram]
    block_sizes: list[int]
    finished: float | None = None


def parse_exposition(text: str) -> Exposition:
    """Parse a Prometheus text exposition; series are matched by sample name, so a family
    without `# TYPE` lines still counts. Malformed series (no `+Inf` bucket) are left out."""
    parts: dict[str, dict[LabelKey, dict]] = {PROMPT: {}, GENERATION: {}}
    block_sizes: list[int] = []
    finished: float | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == FINISHED:
                finished = (finished or 0.0) + sample.value
                continue
            if sample.name == CACHE_INFO:
                size = sample.labels.get("block_size", "")
                if size.isdigit():
                    block_sizes.append(int(size))
                continue
            for name, series in parts.items():
                suffix = sample.name[len(name) :] if sample.name.startswith(name) else None
                if suffix not in ("_bucket", "_sum", "_count"):
                    continue
                labels = {k: v for k, v in sample.labels.items() if k != "le"}
                entry = series.setdefault(tuple(sorted(labels.items())), {"buckets": {}})
                if suffix == "_bucket":
                    entry["buckets"][float(sample.labels["le"])] = sample.value
                else:
                    entry[suffix] = sample.value
    return Exposition(
        _histograms(parts[PROMPT]), _histograms(parts[GENERATION]), block_sizes, finished
    )


def _histograms(series: dict[LabelKey, dict]) -> dict[LabelKey, Histogram]:
    out = {}
    for key, entry in series.items():
        buckets = entry["buckets"]
        if math.inf not in buckets:
            continue
        bounds = tuple(sorted(buckets))
        cumulative = tuple(buckets[b] for b in bounds)
        count = entry.get("_count", cumulative[-1])
        out[key] = Histogram(bounds, cumulative, entry.get("_sum", math.nan), count)
    return out


def _bucket_ranges(bounds: tuple[float, ...], minimum: int) -> tuple[np.ndarray, np.ndarray]:
    """The smallest and largest integer length of each bucket (lo, hi]."""
    lows, highs = [], []
    previous = -math.inf
    for bound in bounds:
        low = minimum if previous == -math.inf else max(minimum, math.floor(previous) + 1)
        high = MAX_TOKENS if bound == math.inf else math.floor(bound)
        lows.append(low)
        highs.append(max(low, min(high, MAX_TOKENS)))
        previous = bound
    return np.asarray(lows, dtype=np.float64), np.asarray(highs, dtype=np.float64)


def spread_samples(histogram: Histogram, *, minimum: int) -> np.ndarray:
    """Integer lengths, one per request counted, each inside its bucket, summing to `sum`.

    `minimum` is the smallest possible length (1 for prompts, 0 for outputs).
    See the module docstring for the placement.
    """
    counts = histogram.bucket_counts().clip(min=0)
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    lows, highs = _bucket_ranges(histogram.bounds, minimum)
    bucket = np.repeat(np.arange(len(counts)), counts)
    rank = np.concatenate([(np.arange(n) + 0.5) / n for n in counts if n])
    low, high = lows[bucket], highs[bucket]
    tail = bucket == len(counts) - 1
    values = low + (high - low) * rank
    target = histogram.sum
    if not math.isfinite(target):
        values[tail] = low[tail]
        return np.round(values).astype(np.int64)
    if tail.any():
        left = target - values[~tail].sum()
        values[tail] = np.clip(left / tail.sum(), low[tail], high[tail])
    residual = target - values.sum()
    movable = ~tail if (~tail).any() else tail
    room = (high - values) if residual > 0 else (values - low)
    room = np.where(movable, room, 0.0)
    if room.sum() > 0:
        share = min(1.0, abs(residual) / room.sum())
        values += np.sign(residual) * share * room
    return _round_keeping_sum(values, low, high)


def _round_keeping_sum(values: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """Round to integers inside [low, high] so that the sum changes by less than one."""
    floors = np.floor(values)
    fractions = values - floors
    missing = int(round(values.sum() - floors.sum()))
    can_rise = floors < high
    order = np.argsort(-np.where(can_rise, fractions, -1.0), kind="stable")
    rise = order[: max(0, min(missing, int(can_rise.sum())))]
    floors[rise] += 1
    return np.clip(floors, low, high).astype(np.int64)


class HistogramTracker:
    """Remembers the last value of each series of one histogram and yields new samples."""

    def __init__(self, minimum: int) -> None:
        self.minimum = minimum
        self._last: dict[LabelKey, Histogram] = {}
        self._baseline = True

    def update(self, series: dict[LabelKey, Histogram]) -> np.ndarray:
        """Samples of the requests added since the last update (none at the first one)."""
        samples = []
        for key, current in series.items():
            delta = current.since(self._last.get(key))
            self._last[key] = current
            if not self._baseline:
                samples.append(spread_samples(delta, minimum=self.minimum))
        self._baseline = False
        return np.concatenate(samples) if samples else np.zeros(0, dtype=np.int64)


class VllmMetricsSource(PollingSource):
    """Scrapes vLLM's `/metrics` every interval and feeds paired length samples to the sink."""

    name = "vllm_metrics"

    def __init__(
        self,
        settings: VllmMetricsSettings,
        sink: Sink,
        on_block_size: Callable[[int], None],
        *,
        seed: int = 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.url = settings.url
        self.interval_s = settings.interval.total_seconds()
        super().__init__()
        self._sink = sink
        self._on_block_size = on_block_size
        self._clock = clock
        self._client = httpx.Client(timeout=settings.timeout.total_seconds())
        self._prompts = HistogramTracker(minimum=1)
        self._outputs = HistogramTracker(minimum=0)
        self._pending_prompts: deque[int] = deque(maxlen=MAX_PENDING)
        self._pending_outputs: deque[int] = deque(maxlen=MAX_PENDING)
        self._rng = np.random.default_rng(seed)
        self._last_scrape: float | None = None
        self._last_finished: float | None = None
        self.block_size: int | None = None

    def poll(self) -> int:
        response = self._client.get(self.url)
        response.raise_for_status()
        return self.ingest(response.text)

    def ingest(self, text: str) -> int:
        """Turn one exposition into observations; the number handed to the sink."""
        now = self._clock()
        exposition = parse_exposition(text)
        if exposition.block_sizes:
            sizes = exposition.block_sizes
            self.block_size = max(set(sizes), key=lambda b: (sizes.count(b), -b))
            self._on_block_size(self.block_size)
        prompts = self._prompts.update(exposition.prompt)
        outputs = self._outputs.update(exposition.generation)
        self._pending_prompts.extend(prompts.tolist())
        self._pending_outputs.extend(outputs.tolist())
        paired = min(len(self._pending_prompts), len(self._pending_outputs))
        since = self._last_scrape
        self._last_scrape = now
        finished = self._finished_since(exposition.finished)
        if finished > 0 and paired == 0:
            self.status.unobserved()
            log_event(
                log,
                "vllm_requests_without_lengths",
                level=logging.WARNING,
                url=str(self.url),
                finished=finished,
                detail=f"{FINISHED} grew but {PROMPT} and {GENERATION} gave no new pairs",
            )
        if paired == 0:
            return 0
        prompt = np.array([self._pending_prompts.popleft() for _ in range(paired)])
        output = np.array([self._pending_outputs.popleft() for _ in range(paired)])
        prompt = self._rng.permutation(prompt)
        output = self._rng.permutation(output)
        start = now if since is None else since
        stamps = start + (now - start) * (np.arange(paired) + 1) / paired
        self._sink(Observations(prompt, output, stamps))
        return paired

    def _finished_since(self, total: float | None) -> int:
        """Requests finished since the previous scrape (0 at the first, or after a reset)."""
        last, self._last_finished = self._last_finished, total
        if total is None or last is None or total < last:
            return 0
        return int(round(total - last))

    def close(self) -> None:
        self._client.close()
