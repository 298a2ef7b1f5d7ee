"""Choose the block size for the next interval from a window snapshot, in serving terms.

`Selector.decide` predicts, for every candidate, what a user would see on the
recent window (`forecast.Forecaster`: the window's requests served again by
the simulator at the observed load and at `policy.headroom` times it), and
compares the candidates on the policy's `goal`: the capacity (the arrival-rate
multiple served within the SLO) or TTFT p99 at the headroom load. It
recommends a switch only when

1. the window holds at least `policy.window.min_samples` requests (below that
   the principled prior B* names a size, but the current one is kept);
2. the size in force's strongest challenger beats it by more than
   `policy.min_gain` on the goal beyond the forecast's noise: the low end of
   `gain_interval` (the challenger's gain over the size in force on every
   bootstrap resample of the window, see `forecast`) is above `min_gain`.
   Otherwise the size in force is kept and `material` is False. Going back
   after a switch is a switch like any other, so it needs such a gain too: a
   size that is better only within the noise never takes over, and never
   flips back. Where the size in force cannot serve the observed load within
   the SLO (capacity below 1x) every capacity is on the search's floor, so the
   candidates are ranked by what they still serve: their token rate when
   saturated (`ranked_by` says which). Where it serves the load, or the
   window's busiest stretch (`peak_load`), with less margin than `min_gain`
   (`at_the_edge`), a backlog builds or not on a fraction
   of a percent of capacity, so there the bar is the challenger search's
   resolution (`CHALLENGER_TOLERANCE`) instead of `min_gain`;
3. the last applied switch (`record_switch`) is at least `policy.min_dwell`
   old (no flapping);
4. the gain pays for the switch: the gain interval's low end x max(min_dwell,
   interval) (the serving
   time the better size wins while it stays in force) exceeds the switch's cost
   (`CostModel.switch_cost_s`: a live swap's pause, or a vLLM restart) times
   `policy.safety_factor`.

The cost model's per-token costs J(B) are reported with every candidate as the
terms behind the step times; they decide only for a size in force that the
calibration cannot price.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from blocktune.kernels import is_power_of_two
from blocktune.tuner.config.calibration import Calibration
from blocktune.tuner.config.jsonable import to_jsonable
from blocktune.tuner.config.policy import Policy
from blocktune.tuner.sim.cost_model import ArticleHeuristic, CandidateCost, CostModel
from blocktune.tuner.sim.forecast import (
    CHALLENGER_TOLERANCE,
    FORECAST_REQUESTS,
    SUSTAINED,
    Forecast,
    Forecaster,
    contenders,
    goal_higher_is_better,
    noise_interval,
    peak_load,
    ranked_quantity,
    relative_gain,
)
from blocktune.tuner.sim.window import WindowSnapshot

__all__ = ["Decision", "InvalidBlockSize", "Selector"]


class InvalidBlockSize(ValueError):
    """The current block size given to the selector is not a power of two."""


@dataclass(frozen=True)
class Decision:
    """The selector's answer: the best size, the prior, every candidate's predicted service
    and cost terms, whether the choice matters (`material`), and why, in words."""

    block_size: int
    prior_block_size: int
    candidates: list[CandidateCost]
    switch: bool
    reason: str
    current_block_size: int
    samples: int
    principled_block_tokens: float | None = None
    article_heuristic: ArticleHeuristic | None = None
    forecasts: list[Forecast] = field(default_factory=list)
    goal: str = "capacity"
    material: bool = False
    gain: float = 0.0
    gain_interval: tuple[float, float] = (0.0, 0.0)
    ranked_by: str = "capacity"
    peak_load: float = 1.0
    switch_cost_s: float = 0.0
    decided_at: float = 0.0

    @property
    def recommended_block_size(self) -> int:
        """The size to run next: the best one when switching, else the one in force."""
        return self.block_size if self.switch else self.current_block_size

    def to_dict(self) -> dict:
        """The decision as strict JSON types (the one JSON form every surface uses)."""
        forecasts = {f.block_size: f for f in self.forecasts}
        return to_jsonable(
            {
                "recommended_block_size": self.recommended_block_size,
                "material": self.material,
                "reason": self.reason,
                "block_size": self.block_size,
                "prior_block_size": self.prior_block_size,
                "current_block_size": self.current_block_size,
                "switch": self.switch,
                "goal": self.goal,
                "goal_higher_is_better": goal_higher_is_better(self.goal),
                "gain": self.gain,
                "gain_interval": list(self.gain_interval),
                "ranked_by": self.ranked_by,
                "peak_load": self.peak_load,
                "switch_cost_s": self.switch_cost_s,
                "samples": self.samples,
                "principled_block_tokens": self.principled_block_tokens,
                "article_heuristic": (
                    None if self.article_heuristic is None else asdict(self.article_heuristic)
                ),
                "decided_at": self.decided_at,
                "candidates": [
                    _candidate_dict(c, forecasts.get(c.block_size)) for c in self.candidates
                ],
            }
        )

    def cost_of(self, block_size: int) -> CandidateCost:
        """The cost record of `block_size` (KeyError if it was not priced)."""
        for cost in self.candidates:
            if cost.block_size == block_size:
                return cost
        raise KeyError(block_size)


def _candidate_dict(cost: CandidateCost, forecast: Forecast | None) -> dict:
    """A candidate's cost terms and, when forecast, its predicted service at the observed
    load (`tokens_per_s`, TTFT, TPOT, ...), at the headroom load and its capacity."""
    row = {**asdict(cost), "kernel_s_per_token": cost.kernel_s_per_token}
    if forecast is not None:
        row.update(asdict(forecast.observed))
        row["headroom"] = asdict(forecast.headroom)
        row["capacity"] = forecast.capacity
        row["capacity_interval"] = list(forecast.capacity_interval)
        row["sustained_tokens_per_s"] = forecast.sustained_tokens_per_s
    return row


class Selector:
    """Decides the block size per interval; remembers the last applied switch for min_dwell."""

    def __init__(
        self,
        policy: Policy,
        calibration: Calibration,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self.cost_model = CostModel(policy, calibration)
        self.forecaster = Forecaster(policy, calibration)
        self._clock = clock
        self._lock = threading.Lock()
        self._last_switch: float | None = None

    @property
    def last_switch(self) -> float | None:
        """Clock time of the last switch recorded with `record_switch`, or None."""
        with self._lock:
            return self._last_switch

    def record_switch(self, at: float) -> None:
        """Note that a switch took effect at clock time `at`: `min_dwell` counts from it."""
        with self._lock:
            self._last_switch = at

    def step(
        self,
        snapshot: WindowSnapshot,
        current_block_size: int,
        apply: Callable[[Decision], int],
        *,
        now: float | None = None,
    ) -> tuple[Decision, int]:
        """Decide, let `apply` carry out a switch, and record it only if it took effect.

        `apply` receives a switching decision and returns the block size in force
        afterwards; the decision and that size are returned. This is the one
        decide-apply-record loop of the sidecar and the replay's adaptive tuner.
        """
        decision = self.decide(snapshot, current_block_size, now=now)
        if not decision.switch:
            return decision, current_block_size
        in_force = apply(decision)
        if in_force == decision.block_size:
            self.record_switch(decision.decided_at)
        return decision, in_force

    def decide(
        self,
        snapshot: WindowSnapshot,
        current_block_size: int,
        *,
        now: float | None = None,
        at_window_rate: bool = False,
    ) -> Decision:
        """The decision for the next interval, given the engine's current block size. With
        `at_window_rate` the forecast's sample is replayed at the whole window's rate
        (`Forecaster.workload_of`), so capacities are multiples of the window's load."""
        if not is_power_of_two(current_block_size):
            raise InvalidBlockSize(
                f"current block size must be a power of two, got {current_block_size!r}"
            )
        now = self._clock() if now is None else now
        with self._lock:
            return self._decide(snapshot, current_block_size, now, at_window_rate)

    def _decide(
        self, snapshot: WindowSnapshot, current: int, now: float, at_window_rate: bool
    ) -> Decision:
        policy, model = self.policy, self.cost_model
        prompts, outputs = snapshot.prompt_tokens, snapshot.output_tokens
        generated = int(outputs.sum())
        base = {
            "current_block_size": current,
            "samples": snapshot.count,
            "decided_at": now,
            "goal": policy.goal,
        }
        if generated == 0:
            seen = (
                "no request in the window yet"
                if snapshot.count == 0
                else f"the {snapshot.count} requests in the window generated no tokens"
            )
            reason = f"{seen}: keep B={current}"
            return Decision(current, current, [], False, reason, **base)
        mean_context = float((prompts * outputs + outputs * (outputs + 1) / 2).sum() / generated)
        optimum, prior = model.principled_block_size(mean_context)
        article = model.article_heuristic(float(snapshot.total.median))
        # A size in force that the calibration cannot price (e.g. reported by vLLM) is left
        # out: the cheapest candidate then wins without a forecast.
        calibrated = current in model.calibration.block_sizes
        priced = tuple(sorted({*policy.candidates, current} if calibrated else policy.candidates))
        costs = model.costs(
            prompts, outputs, shared_prefixes=snapshot.shared_prefixes, block_sizes=priced
        )
        base.update(principled_block_tokens=optimum, article_heuristic=article, candidates=costs)
        if snapshot.count < policy.window.min_samples:
            reason = (
                f"only {snapshot.count} of the {policy.window.min_samples} requests a decision "
                "needs are in the window: "
                f"keep B={current} (the prior B*={optimum:.1f} tokens suggests {prior})"
            )
            return Decision(prior, prior, switch=False, reason=reason, **base)
        if not calibrated:
            best = min(costs, key=lambda c: (c.objective_s_per_token, c.block_size)).block_size
            reason = (
                f"B={current} has no calibrated costs: switch to the cheapest calibrated "
                f"candidate B={best}"
            )
            return Decision(best, prior, switch=True, reason=reason, material=True, **base)
        workload = self.forecaster.workload_of(snapshot, at_window_rate=at_window_rate)
        if workload is None:
            reason = f"the window's requests span no time, so no load to forecast: keep B={current}"
            return Decision(current, prior, switch=False, reason=reason, **base)
        forecasts = self.forecaster.forecast(workload, current, priced)
        base["peak_load"] = peak_load(snapshot, at_window_rate=at_window_rate)
        return self._choose(forecasts, current, prior, now, base)

    def _choose(
        self, forecasts: list[Forecast], current: int, prior: int, now: float, base: dict
    ) -> Decision:
        """The decision among forecast candidates (rules 2-4 of the module docstring)."""
        policy = self.policy
        by_size = {f.block_size: f for f in forecasts}
        quantity = ranked_quantity(policy.goal, by_size[current].capacity)
        pair = contenders(forecasts, current, quantity, policy.candidates)
        challenger = by_size[pair[-1]]
        gain = relative_gain(quantity, challenger.value(quantity), by_size[current].value(quantity))
        gains = [
            relative_gain(quantity, mine, theirs)
            for mine, theirs in zip(
                challenger.values(quantity), by_size[current].values(quantity), strict=True
            )
        ]
        interval = noise_interval(np.array(gains), gain)
        peak = base["peak_load"]
        edge = quantity == "capacity" and at_the_edge(by_size[current], policy.min_gain, peak)
        bar = CHALLENGER_TOLERANCE if edge else policy.min_gain
        material = challenger.block_size != current and interval[0] > bar
        base.update(
            forecasts=forecasts,
            material=material,
            gain=gain,
            gain_interval=interval,
            ranked_by=quantity,
        )
        decision = {"block_size": challenger.block_size, "prior_block_size": prior}
        regime = ""  # how the sizes were compared, where that is not the plain rule
        if quantity == SUSTAINED:
            regime = (
                f"overloaded (B={current} serves {by_size[current].capacity:.2g}x the observed "
                f"load within the SLO): ranking by {SUSTAINED}; "
            )
        elif edge:
            low, high = by_size[current].capacity_interval
            busiest = (
                f"; the window's busiest {FORECAST_REQUESTS} requests offered {peak:.3g}x it"
                if peak > 1.0
                else ""
            )
            regime = (
                f"at the edge of the SLO (B={current} serves {low:.3g}-{high:.3g}x the observed "
                f"load{busiest}: less margin than min_gain {policy.min_gain:.0%}), where any "
                f"capacity gain keeps requests within it: the bar is {bar:.1%}; "
            )
        if not material:
            decision["block_size"] = current
            reason = regime + _why_keep(
                current, challenger.block_size, quantity, gain, interval, bar
            )
            return Decision(switch=False, reason=reason, **decision, **base)
        cost = self.cost_model.switch_cost_s()
        base["switch_cost_s"] = cost
        better = (
            f"{regime}B={challenger.block_size} is {_span(interval)} better on {quantity} "
            f"({_describe(quantity, challenger)}), beyond the forecast's noise and "
            + (f"the bar {bar:.1%}" if edge else f"min_gain {policy.min_gain:.0%}")
        )
        if self._last_switch is not None and now - self._last_switch < self._min_dwell_s:
            reason = (
                f"{better}, but the last switch was {now - self._last_switch:.0f} s ago "
                f"(min_dwell {self._min_dwell_s:.0f} s): keep B={current}"
            )
            return Decision(switch=False, reason=reason, **decision, **base)
        payback = interval[0] * max(self._min_dwell_s, policy.interval.total_seconds())
        if payback <= cost * policy.safety_factor:
            reason = (
                f"{better}, but while it stays in force that wins {payback:.3g} s of serving, "
                "not more "
                f"than the switch cost {cost:.3g} s x safety {policy.safety_factor:g}: "
                f"keep B={current}"
            )
            return Decision(switch=False, reason=reason, **decision, **base)
        reason = f"switch B={current} -> {challenger.block_size}: {better}"
        return Decision(switch=True, reason=reason, **decision, **base)

    @property
    def _min_dwell_s(self) -> float:
        return self.policy.min_dwell.total_seconds()


def at_the_edge(forecast: Forecast, min_gain: float, peak: float = 1.0) -> bool:
    """Whether `forecast`'s size serves the observed load within the SLO with less margin than
    `min_gain` over the window's `peak_load` (`peak`, its busiest stretch, 1 for a steady
    one): its capacity is at least 1x, the low end of its interval below peak x (1 +
    min_gain). There a backlog builds or not on a fraction of a percent of capacity, so a
    smaller gain than `min_gain` already keeps many requests within the SLO."""
    return forecast.capacity >= 1.0 and forecast.capacity_interval[0] < peak * (1.0 + min_gain)


def _describe(quantity: str, forecast: Forecast) -> str:
    """The ranked quantity's value of one forecast, in words."""
    if quantity == "capacity":
        low, high = forecast.capacity_interval
        return (
            f"serves {forecast.capacity:.3g}x the observed load within the SLO, "
            f"{low:.3g}-{high:.3g}x over the resamples"
        )
    if quantity == SUSTAINED:
        return f"{forecast.sustained_tokens_per_s:.4g} tokens/s when saturated"
    return f"TTFT p99 {forecast.headroom.ttft_p99_s:.3g} s at the headroom load"


def _why_keep(
    current: int,
    other: int,
    quantity: str,
    gain: float,
    interval: tuple[float, float],
    min_gain: float,
) -> str:
    """Why the size in force stays, in words: the best other size is worse, within min_gain,
    or better only within the forecast's noise."""
    versus = f"B={other}: {gain:+.1%}, {_span(interval)} over the resamples"
    if interval[1] < 0:
        return f"B={current} is the best candidate on {quantity} (the next, {versus}): keep it"
    if interval[1] <= min_gain:
        return (
            f"at this load every candidate is within {min_gain:.0%} of B={current} on "
            f"{quantity} (the best other, {versus}): keep B={current}"
        )
    return (
        f"B={other} is {_span(interval)} against B={current} on {quantity}: the difference is "
        f"within the forecast's noise (±{_half_width(interval):.1%}), its low end not above "
        f"min_gain {min_gain:.0%}: keep B={current}"
    )


def _span(interval: tuple[float, float]) -> str:
    """A gain interval in words: "3.1-7.4%" or "-1.2 to +0.8%"."""
    low, high = (100 * v for v in interval)
    if low >= 0:
        return f"{low:.1f}-{high:.1f}%"
    return f"{low:+.1f} to {high:+.1f}%"


def _half_width(interval: tuple[float, float]) -> float:
    return (interval[1] - interval[0]) / 2
