"""What a user would see at each candidate block size: the recent window, served again.

The window's latest requests (their lengths and arrival process) are replayed
through the serving simulator that `blocktune replay` runs, once per candidate
block size, at the observed load and at the policy's `headroom` multiple of it.
Each run gives the metrics a user feels (`ServedMetrics`: tokens/s, TTFT and TPOT
percentiles, peak KV, preemptions). The **capacity** of a block size is the
largest multiple of the observed arrival rate at which the policy's SLO (TTFT
p99 and TPOT p99) still holds, found by bisection on a log scale within
`CAPACITY_RANGE`, and which the server sustains.

A sample of `FORECAST_REQUESTS` requests is short: at a high request rate it
spans a second or two, and a server absorbs that as one burst whatever its
block size, so its TTFT stays within the SLO at any load multiple even where
the queue would grow without bound. A load is therefore also held to what the
server sustains: its **sustained load** is the token rate it generates when
saturated (the sample repeated to fill its pool or batch `SATURATION_FILLS`
times over, all arriving at once) over the observed one (the sample's
requests per second times their mean output). The saturated run is timed between its first and third
quartile of completions, away from the first admissions and the last
stragglers, each request's tokens spread evenly over its decode. Above it the
queue grows, so no multiple above it counts as within the SLO.

Every candidate's capacity is searched finely, so that no gain comes from the
search's own resolution: the size in force first, to `CAPACITY_TOLERANCE`
(0.2%, a tenth of the default `min_gain`), then every other size from a
bracket around it, to `CHALLENGER_TOLERANCE` (0.5%, or `FAR_SHARE` of its
distance from the size in force's capacity where coarser). The others are
searched in the order of their sustained loads, and where candidates are
ranked on capacity one found to be below a challenger already searched (it
can be neither the strongest challenger nor ranked against the size in
force) only to `SETTLED_TOLERANCE`. A
search brackets the capacity by steps from its guess (at least as far as the
SLO margin there suggests, see `_slope`) and narrows the bracket where the
SLO margin, interpolated between its ends, crosses zero (`_narrow`, bisection
where that does not converge); a capacity the sustained load bounds is that
load exactly. Capacities are taken as monotone in the load multiple (more
load never serves faster), which is what the search relies on; for a sample
of 128 requests a p99 is not strictly so, so a reported capacity is a load
that passes with a failing one within the tolerance above it.

**Noise.** A sample of 128 requests is one draw of the traffic: the next
window's capacities differ by a few percent although nothing changed. The
forecast measures that noise on the sample itself with a bootstrap:
`BOOTSTRAP_RESAMPLES` resamples, each drawing the sample's requests (their
prompt and output lengths) with replacement onto the sample's own arrival
times, from a fixed seed (the same window always gives the same answer). The
arrival times are kept because a burst is what a TTFT p99 measures: gaps drawn
independently smooth the bursts away and overstate every capacity. Each resample is
forecast again (capacity to `RESAMPLE_TOLERANCE`, the size in force's from
its capacity on the sample, the challenger's from the size in force's on the
same resample times their ratio on the sample, by steps of that tolerance; its
saturated token rate; its TTFT p99 at headroom), every candidate on the same
resamples, so that a comparison of two sizes is paired.
`Forecast.capacity_interval` is the `INTERVAL_PERCENTILES` range of a
candidate's resampled capacities; the selector takes the same range of the
per-resample gains for `gain_interval`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from blocktune.tuner.config.calibration import Calibration
from blocktune.tuner.config.engine_settings import engine_settings
from blocktune.tuner.config.policy import Policy, SloSettings
from blocktune.tuner.sim.served import ServedMetrics, percentiles
from blocktune.tuner.sim.simulator import Run, simulate
from blocktune.tuner.sim.step_cost import StepCostModel
from blocktune.tuner.sim.window import WindowSnapshot
from blocktune.tuner.sim.workload import Workload

__all__ = [
    "CAPACITY_RANGE",
    "CAPACITY_TOLERANCE",
    "FORECAST_REQUESTS",
    "SUSTAINED",
    "Estimate",
    "Forecast",
    "Forecaster",
    "noise_interval",
    "offered_tokens_per_s",
    "peak_load",
    "window_rate_scale",
]

FORECAST_REQUESTS = 128
"""The window's latest requests a forecast replays (a window holds up to its capacity)."""

CAPACITY_RANGE = (1 / 4096, 64.0)
"""The multiples of the observed arrival rate a capacity search spans (its result is clamped)."""

CAPACITY_TOLERANCE = 0.002
"""Relative width to which every candidate's capacity on the sample is bisected."""

CHALLENGER_TOLERANCE = 0.005
"""Relative width to which the capacity of every other candidate is bisected (its result is the
last load that passed, so a coarser search can only understate a challenger)."""

FAR_SHARE = 1 / 8
"""A challenger whose capacity is bracketed a distance d (log ratio) away from the size in
force's is bisected only to d x this: its ranking against the size in force is settled."""

SETTLED_TOLERANCE = 0.05
"""Relative width to which a challenger's capacity is narrowed once it is known to be below
another challenger's: it is neither the strongest challenger nor reported as one."""

RESAMPLE_TOLERANCE = 0.03
"""Relative width to which a capacity is bisected on a bootstrap resample."""

BRACKET_STEP = 1.05
"""The first step of a capacity search away from its starting guess (squared at every further
step), so that a capacity near the guess is bracketed in two runs."""

BOOTSTRAP_RESAMPLES = 3
"""Bootstrap resamples of the forecast's sample behind every interval (see the module
docstring)."""

BOOTSTRAP_SEED = 0
"""The resamples' seed: the same window always gives the same intervals."""

INTERVAL_PERCENTILES = (10.0, 90.0)
"""The percentiles of the resampled values that bound a reported interval."""

MARGIN_STEP_LIMIT = 2.0
"""The largest first step of a search that the SLO margin may suggest (see `_slope`)."""

MARGIN_FLOOR = 1e-9
"""The smallest p99-over-limit ratio a margin takes (a run of no latency has a finite log)."""

SATURATION_FILLS = 4
"""How many times over a saturation run's requests fill the pool or batch (see the module
docstring)."""


@dataclass(frozen=True)
class Estimate:
    """One candidate on one sample: its capacity (load multiple), the token rate it generates
    when saturated and its TTFT p99 at the headroom load."""

    capacity: float
    sustained_tokens_per_s: float
    headroom_ttft_p99_s: float

    def value(self, quantity: str) -> float:
        """The estimate's `quantity`: a goal (capacity, ttft_p99) or `SUSTAINED`."""
        if quantity == "capacity":
            return self.capacity
        if quantity == SUSTAINED:
            return self.sustained_tokens_per_s
        return self.headroom_ttft_p99_s


SUSTAINED = "sustained tokens/s"
"""The quantity ranked when the size in force cannot serve the observed load (capacity
below 1x): the token rate each size generates when saturated."""


@dataclass(frozen=True)
class Forecast:
    """One candidate's predicted service: at the observed load, at headroom, its capacity and
    saturated token rate, and the same on every bootstrap resample (`resampled`)."""

    block_size: int
    observed: ServedMetrics
    headroom: ServedMetrics
    capacity: float
    sustained_tokens_per_s: float = math.nan
    resampled: tuple[Estimate, ...] = ()
    capacity_interval: tuple[float, float] = (math.nan, math.nan)

    @property
    def estimate(self) -> Estimate:
        """The sample's own estimate (not a resample's)."""
        return Estimate(self.capacity, self.sustained_tokens_per_s, self.headroom.ttft_p99_s)

    def goal_value(self, goal: str) -> float:
        """The policy goal's value: the capacity, or TTFT p99 at the headroom load."""
        return self.value(goal)

    def value(self, quantity: str) -> float:
        """The sample's value of `quantity` (see `Estimate.value`)."""
        return self.estimate.value(quantity)

    def values(self, quantity: str) -> np.ndarray:
        """The resamples' values of `quantity`."""
        return np.array([e.value(quantity) for e in self.resampled])


def offered_tokens_per_s(arrival_s: np.ndarray, output_tokens: np.ndarray) -> float:
    """The output tokens per second that requests arriving at `arrival_s` (sorted) offer: all
    but the last one's over the span of their arrivals (inf where they span no time)."""
    span = float(arrival_s[-1] - arrival_s[0])
    return float(np.sum(output_tokens[:-1])) / span if span > 0 else math.inf


def window_rate_scale(arrival_s: np.ndarray, output_tokens: np.ndarray, latest: int) -> float:
    """The factor that makes the `latest` requests' gaps offer the output tokens per second of
    all the requests (`arrival_s` sorted): the sample's offered rate over the window's. A
    bursty trace's last seconds can arrive far slower or faster than its window does."""
    window = offered_tokens_per_s(arrival_s, output_tokens)
    sample = offered_tokens_per_s(arrival_s[-latest:], output_tokens[-latest:])
    if not (math.isfinite(window) and math.isfinite(sample) and window > 0):
        return 1.0
    return sample / window


def peak_load(snapshot: WindowSnapshot, *, at_window_rate: bool = False) -> float:
    """The busiest stretch of `FORECAST_REQUESTS` consecutive requests in the window, in
    multiples of the load the forecast's capacities count in (the window's with
    `at_window_rate`, else its sample's, the latest requests): the output tokens per second
    that stretch offers (as `offered_tokens_per_s` counts them) over that load, at least 1.
    A capacity below it means the window held a stretch that the size would not have served
    within the SLO: a backlog built there, and how fast it drained depends on fractions of a
    percent of capacity."""
    order = np.argsort(snapshot.timestamps, kind="stable")
    stamps = snapshot.timestamps[order]
    outputs = np.maximum(snapshot.output_tokens[order], 1)
    n = min(FORECAST_REQUESTS, len(stamps))
    if n < 2:
        return 1.0
    sample = slice(None) if at_window_rate else slice(len(stamps) - n, None)
    reference = offered_tokens_per_s(stamps[sample], outputs[sample])
    spans = stamps[n - 1 :] - stamps[: len(stamps) - n + 1]
    sums = np.concatenate(([0], np.cumsum(outputs)))
    tokens = sums[n - 1 : len(stamps)] - sums[: len(stamps) - n + 1]  # all but each one's last
    timed = spans > 0
    if not (timed.any() and math.isfinite(reference) and reference > 0):
        return 1.0
    return max(1.0, float(np.max(tokens[timed] / spans[timed])) / reference)


def noise_interval(values: np.ndarray, point: float) -> tuple[float, float]:
    """The `INTERVAL_PERCENTILES` range of the resampled `values`, widened to hold the sample's
    own `point` estimate (a heavy-tailed sample, whose p99 rests on one or two requests, can
    fall outside its resamples' range)."""
    if not len(values):
        return (point, point)
    low, high = percentiles(values, INTERVAL_PERCENTILES)
    return (min(float(low), point), max(float(high), point))


def ranked_quantity(goal: str, current_capacity: float) -> str:
    """What the candidates are ranked on: the goal, or `SUSTAINED` where the size in force
    cannot serve the observed load within the SLO (capacity below 1x)."""
    return SUSTAINED if current_capacity < 1.0 else goal


def contenders(
    forecasts: list[Forecast], current: int, quantity: str, candidates: tuple[int, ...]
) -> tuple[int, ...]:
    """The size in force and its strongest challenger among `candidates` on `quantity` (the
    best other candidate, ties to the smaller size): the sizes a decision compares."""
    sign = 1 if goal_higher_is_better(quantity) else -1
    others = [f for f in forecasts if f.block_size in candidates and f.block_size != current]
    if not others:
        return (current,)
    best = max(others, key=lambda f: (sign * f.value(quantity), -f.block_size))
    return current, best.block_size


def goal_higher_is_better(goal: str) -> bool:
    """Capacity (and `SUSTAINED`) is maximised; a latency is minimised."""
    return goal != "ttft_p99"


def relative_gain(goal: str, candidate: float, reference: float) -> float:
    """How much better `candidate` is than `reference` on `goal`, as a fraction of it."""
    if not reference > 0:
        return math.inf if candidate > reference and goal_higher_is_better(goal) else 0.0
    if goal_higher_is_better(goal):
        return candidate / reference - 1
    return 1 - candidate / reference


class Forecaster:
    """Replays a window's requests through the serving simulator for each block size."""

    def __init__(self, policy: Policy, calibration: Calibration) -> None:
        self.policy = policy
        self.server = StepCostModel(policy, calibration)

    def workload_of(
        self, snapshot: WindowSnapshot, *, at_window_rate: bool = False
    ) -> Workload | None:
        """The window's latest `FORECAST_REQUESTS` requests as a workload, arriving at their
        recorded times (less those no pool could hold), or None without two of them over a
        time span. With `at_window_rate` their gaps are scaled so that they offer the whole
        window's output tokens per second (see `window_rate_scale`): load multiples then
        count in the window's load, not the sample's."""
        order = np.argsort(snapshot.timestamps, kind="stable")
        sample = order[-FORECAST_REQUESTS:]
        stamps = snapshot.timestamps[sample]
        if len(stamps) < 2 or not stamps[-1] > stamps[0]:
            return None
        scale = 1.0
        if at_window_rate:
            scale = window_rate_scale(
                snapshot.timestamps[order],
                np.maximum(snapshot.output_tokens[order], 1),
                len(sample),
            )
        fits = min(self.server.capacity_slots(b) for b in self.policy.candidates)
        workload = Workload.of_lengths(
            (stamps - stamps[0]) * scale,
            np.maximum(snapshot.prompt_tokens[sample], 1),
            np.maximum(snapshot.output_tokens[sample], 1),
        ).without_longer_than(fits)
        return workload if len(workload) >= 2 else None

    def metrics(self, workload: Workload, block_size: int, load: float) -> ServedMetrics:
        """Serve `workload` at `load` times its arrival rate at a fixed `block_size`."""
        scaled = replace(workload, arrival_s=workload.arrival_s / load)
        return ServedMetrics.of(simulate(scaled, self.server, block_size), scaled)

    def sustained_load(self, workload: Workload, block_size: int) -> float:
        """The multiple of `workload`'s arrival rate that the server sustains at `block_size`:
        its generated-token rate when saturated over the observed one (see the module
        docstring)."""
        return self._saturated(workload, block_size)[0]

    def _saturated(self, workload: Workload, block_size: int) -> tuple[float, float]:
        """The sustained load multiple and the generated tokens/s when saturated."""
        span = float(workload.arrival_s[-1] - workload.arrival_s[0])
        held = float(np.mean(workload.total_tokens))
        rows = engine_settings(self.policy).max_num_seqs
        at_once = min(rows, self.server.capacity_slots(block_size) / held)
        copies = max(1, math.ceil(SATURATION_FILLS * at_once / len(workload)))
        saturated = Workload.of_lengths(
            np.zeros(copies * len(workload)),
            np.tile(workload.prompt_tokens, copies),
            np.tile(workload.output_tokens, copies),
        )
        run = simulate(saturated, self.server, block_size)
        start_s, end_s = np.quantile(run.finish_s, [0.25, 0.75])
        if not end_s > start_s:
            start_s, end_s = 0.0, run.end_s
        served = _tokens_between(run, saturated.output_tokens, start_s, end_s) / (end_s - start_s)
        offered = float(np.mean(workload.output_tokens)) * (len(workload) - 1) / span
        return float(served / offered), float(served)

    def resamples(self, workload: Workload) -> list[Workload]:
        """`BOOTSTRAP_RESAMPLES` bootstrap resamples of `workload`: its requests (their prompt
        and output lengths) drawn with replacement onto its own arrival times."""
        rng = np.random.default_rng(BOOTSTRAP_SEED)
        n = len(workload)
        out = []
        for _ in range(BOOTSTRAP_RESAMPLES):
            rows = rng.integers(0, n, n)
            out.append(
                Workload.of_lengths(
                    workload.arrival_s, workload.prompt_tokens[rows], workload.output_tokens[rows]
                )
            )
        return out

    def forecast(
        self, workload: Workload, current: int, block_sizes: tuple[int, ...]
    ) -> list[Forecast]:
        """A `Forecast` per block size; `current` (the size in force) is priced first, the
        others searched from its capacity, and the two contenders (see `contenders`) forecast
        again on every bootstrap resample (see the module docstring)."""
        policy = self.policy
        runs = {
            b: (self.metrics(workload, b, 1.0), self.metrics(workload, b, policy.headroom))
            for b in block_sizes
        }
        saturated = {b: self._saturated(workload, b) for b in block_sizes}
        slopes = {b: _slope(runs[b], policy) for b in block_sizes}
        observed, at_headroom = runs[current]
        start = 0.5
        if observed.meets(policy.slo):
            start = policy.headroom if at_headroom.meets(policy.slo) else 1.0
        reference = self._search(
            workload, current, saturated[current][0], start, 2.0, known=runs[current]
        )
        capacities = {current: reference}
        settle_at = -math.inf  # the best challenger's capacity so far (on capacity only)
        others = sorted(set(block_sizes) - {current}, key=lambda b: (-saturated[b][0], b))
        for b in others:
            capacities[b] = self._search(
                workload,
                b,
                saturated[b][0],
                reference,
                BRACKET_STEP,
                CHALLENGER_TOLERANCE,
                known=runs[b],
                far_share=FAR_SHARE,
                settle_at=settle_at
                if ranked_quantity(policy.goal, reference) == "capacity"
                else -math.inf,
            )
            if b in policy.candidates:
                settle_at = max(settle_at, capacities[b])
        point = {b: Forecast(b, *runs[b], capacities[b], saturated[b][1]) for b in block_sizes}
        quantity = ranked_quantity(policy.goal, reference)
        pair = contenders(list(point.values()), current, quantity, policy.candidates)
        resampled = self._resampled(workload, pair, capacities, slopes)
        relative = np.array([e.capacity for e in resampled[current]]) / reference
        out = []
        for b, forecast in point.items():
            if b in resampled:
                estimates = tuple(resampled[b])
                interval = noise_interval(np.array([e.capacity for e in estimates]), capacities[b])
            else:  # not a contender: the size in force's relative noise around its capacity
                estimates = ()
                interval = noise_interval(relative * capacities[b], capacities[b])
            out.append(replace(forecast, resampled=estimates, capacity_interval=interval))
        return out

    def _resampled(
        self,
        workload: Workload,
        sizes: tuple[int, ...],
        capacities: dict[int, float],
        slopes: dict[int, float | None],
    ) -> dict[int, list[Estimate]]:
        """Each of `sizes` estimated again on every bootstrap resample, the first of them (the
        size in force) from its own capacity, the others from the first's capacity on the same
        resample times their ratio on the sample (paired)."""
        headroom, first = self.policy.headroom, sizes[0]
        out: dict[int, list[Estimate]] = {b: [] for b in sizes}
        for sample in self.resamples(workload):
            anchor = capacities[first]
            for b in sizes:
                sustained, tokens_per_s = self._saturated(sample, b)
                if b == first:
                    guess, step = capacities[b], BRACKET_STEP
                else:  # paired: the ratio on the sample is the likeliest on the resample
                    guess = anchor * capacities[b] / capacities[first]
                    step = 1 + RESAMPLE_TOLERANCE
                capacity = self._search(
                    sample, b, sustained, guess, step, RESAMPLE_TOLERANCE, slope=slopes[b]
                )
                if b == first:
                    anchor = capacity
                ttft = math.nan
                if self.policy.goal == "ttft_p99":
                    ttft = self.metrics(sample, b, headroom).ttft_p99_s
                out[b].append(Estimate(capacity, tokens_per_s, ttft))
        return out

    def meets(self, workload: Workload, block_size: int, load: float) -> bool:
        """Whether the SLO holds at `load` times the arrival rate and the server sustains it."""
        return _Meets(self, workload, block_size, self.sustained_load(workload, block_size))(load)

    def _search(
        self,
        workload: Workload,
        block_size: int,
        sustained: float,
        guess: float,
        step: float,
        tolerance: float = CAPACITY_TOLERANCE,
        known: tuple[ServedMetrics, ServedMetrics] | None = None,
        far_share: float = 0.0,
        settle_at: float = -math.inf,
        slope: float | None = None,
    ) -> float:
        """The capacity of `block_size` on `workload`: bracketed from `guess` by steps of
        `step` (at least as far as the SLO margin at `guess` over its `slope` per unit of log
        load, where given, up to `MARGIN_STEP_LIMIT`; squared at every further step) within
        `CAPACITY_RANGE`, then narrowed to `tolerance`, or to `far_share` of the bracket's
        distance from `guess` where that is coarser, and only to `SETTLED_TOLERANCE` once it
        is known to be at most `settle_at`. `known` are its runs at the observed and the
        headroom load."""
        low_limit, high_limit = CAPACITY_RANGE
        meets = _Meets(self, workload, block_size, sustained)
        if known is not None:
            meets.learn(1.0, known[0])
            meets.learn(self.policy.headroom, known[1])
        guess = min(max(guess, low_limit), high_limit)
        passed = meets(guess)
        if slope is not None and guess in meets.margins:
            suggested = min(abs(meets.margins[guess]) / slope, math.log(MARGIN_STEP_LIMIT))
            step = max(step, math.exp(suggested))
        if passed:
            low, high = guess, min(guess * step, high_limit)
            while meets(high):
                if high >= high_limit:
                    return high_limit  # served within the SLO at the top of the range
                low, step = high, step * step
                high = min(low * step, high_limit)
        else:
            low, high = max(guess / step, low_limit), guess
            while not meets(low):
                if low <= low_limit:
                    return low_limit  # not served within the SLO even at the bottom
                high, step = low, step * step
                low = max(high / step, low_limit)
        distance = min(abs(math.log(low / guess)), abs(math.log(high / guess)))
        return _narrow(meets, low, high, max(tolerance, far_share * distance), settle_at)


def _narrow(
    meets: _Meets,
    low: float,
    high: float,
    tolerance: float,
    settle_at: float = -math.inf,
) -> float:
    """Narrow a passing `low` and a failing `high` down until they are within `tolerance` of one
    another, or of `SETTLED_TOLERANCE` once `high` is at most `settle_at`; returns the last
    passing multiple.

    An end above the sustained load fails without a run, so the sustained load itself is
    probed first (where it passes it is the capacity). Then each probe is where the SLO margin
    (`_margin`), interpolated linearly in the log of the load between the two ends, crosses
    zero, kept half the tolerance inside the bracket, so that a good estimate is closed from
    both sides in one more probe; where interpolation has not halved the bracket in two probes
    in a row, the probe is the geometric midpoint (bisection). A settled bracket (`high` at
    most `settle_at`) is bisected: interpolation would place its probe half the fine
    tolerance from the crossing, where a coarse one is all that is asked."""
    if high > meets.sustained > low:
        if meets(meets.sustained):
            return meets.sustained  # every load above the sustained one fails
        high = meets.sustained
    slow = 0  # interpolated probes in a row that did not halve the bracket
    while high / low > 1 + (tolerance if high > settle_at else max(tolerance, SETTLED_TOLERANCE)):
        interpolated = None
        if slow < 2 and high > settle_at:
            interpolated = _interpolated(meets, low, high, tolerance)
        probe = math.sqrt(low * high) if interpolated is None else interpolated
        width = math.log(high / low)
        if meets(probe):
            low = probe
        else:
            high = probe
        halved = math.log(high / low) <= width / 2
        slow = slow + 1 if interpolated is not None and not halved else 0
    return low


def _interpolated(meets: _Meets, low: float, high: float, tolerance: float) -> float | None:
    """The load between `low` and `high` where their SLO margins, interpolated linearly in the
    log of the load, cross zero, at least half of `tolerance` inside either end (None where an
    end's margin is unknown or the margins do not bracket zero)."""
    below, above = meets.margins.get(low), meets.margins.get(high)
    if below is None or above is None or not below <= 0 < above:
        return None
    a, b = math.log(low), math.log(high)
    x = a + (b - a) * (-below) / (above - below)
    inset = math.log1p(tolerance) / 2
    return math.exp(min(max(x, a + inset), b - inset))


def _slope(runs: tuple[ServedMetrics, ServedMetrics], policy: Policy) -> float | None:
    """How fast the SLO margin grows per unit of log load, between a size's runs at the
    observed and at the headroom load (None where it does not grow): a chord, so at most the
    slope near the capacity, and a step it suggests overshoots rather than falls short."""
    rise = _margin(runs[1], policy.slo) - _margin(runs[0], policy.slo)
    return rise / math.log(policy.headroom) if rise > 0 and policy.headroom > 1 else None


def _margin(metrics: ServedMetrics, slo: SloSettings) -> float:
    """How far a run is from the SLO: the log of its tightest p99 over its limit (at most 0
    exactly where `ServedMetrics.meets` holds; no TPOT counts as within)."""
    ratio = metrics.ttft_p99_s / slo.ttft_p99_s
    if not math.isnan(metrics.tpot_p99_s):
        ratio = max(ratio, metrics.tpot_p99_s / slo.tpot_p99_s)
    return math.log(max(ratio, MARGIN_FLOOR))


def _tokens_between(run: Run, outputs: np.ndarray, start_s: float, end_s: float) -> float:
    """Tokens `run` generated from `start_s` to `end_s`, each request's spread evenly from
    its first token to its last."""
    first, finish = run.first_token_s, run.finish_s
    overlap = np.clip(np.minimum(finish, end_s) - np.maximum(first, start_s), 0.0, None)
    duration = finish - first
    share = np.where(
        duration > 0,
        overlap / np.where(duration > 0, duration, 1.0),
        (first >= start_s) & (first <= end_s),
    )
    return float((share * outputs).sum())


@dataclass(frozen=True)
class _Meets:
    """Whether one block size meets the SLO at a load multiple and sustains it."""

    forecaster: Forecaster
    workload: Workload
    block_size: int
    sustained: float
    margins: dict[float, float] = field(default_factory=dict)
    """The SLO margin (`_margin`) at a load multiple, for the loads already served."""

    def __call__(self, load: float) -> bool:
        if load > self.sustained:
            return False
        if load not in self.margins:
            self.learn(load, self.forecaster.metrics(self.workload, self.block_size, load))
        return self.margins[load] <= 0

    def learn(self, load: float, metrics: ServedMetrics) -> None:
        """Remember the margin of a run served at `load`."""
        self.margins[load] = _margin(metrics, self.forecaster.policy.slo)
