"""Choose the block size for the next interval from a window snapshot.

`Selector.decide` prices every candidate with the cost model and picks the
cheapest. It recommends a switch only when

1. the window holds at least `policy.window.min_samples` requests (below that
   the principled prior B* names a size, but the current one is kept);
2. the last applied switch (`record_switch`) is at least `policy.min_dwell`
   old (no flapping);
3. the predicted gain over the next interval exceeds the swap cost times
   `policy.safety_factor`.

Gain [s] = tokens expected in the next interval x (J(current) - J(best)), with
the tokens taken from the window's observed output rate, capped by what a
saturated engine at J(current) could generate in one interval.
Swap cost [s] = bytes to move / calibrated copy bandwidth. A shrink (B -> B/2^k)
moves nothing: each old block is a run of new ones. A grow is priced as
`policy.grow_copy_fraction` (default 1.0, an upper bound; blocktune's aligned
allocator usually copies nothing) of the useful tokens the budget holds at the
current size, times the KV bytes per token.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from blocktune.kernels import is_power_of_two
from blocktune.tuner.core.calibration import Calibration
from blocktune.tuner.core.cost_model import ArticleHeuristic, CandidateCost, CostModel
from blocktune.tuner.core.jsonable import to_jsonable
from blocktune.tuner.core.policy import Policy
from blocktune.tuner.core.window import WindowSnapshot

__all__ = ["Decision", "InvalidBlockSize", "Selector"]


class InvalidBlockSize(ValueError):
    """The current block size given to the selector is not a power of two."""


@dataclass(frozen=True)
class Decision:
    """The selector's answer: the best size, the prior, every candidate's costs, and why."""

    block_size: int
    prior_block_size: int
    candidates: list[CandidateCost]
    switch: bool
    reason: str
    current_block_size: int
    samples: int
    principled_block_tokens: float | None = None
    article_heuristic: ArticleHeuristic | None = None
    predicted_gain_s: float = 0.0
    swap_cost_s: float = 0.0
    decided_at: float = 0.0

    def to_dict(self) -> dict:
        """The decision as strict JSON types (the one JSON form every surface uses)."""
        return to_jsonable(
            {
                "block_size": self.block_size,
                "prior_block_size": self.prior_block_size,
                "current_block_size": self.current_block_size,
                "switch": self.switch,
                "reason": self.reason,
                "samples": self.samples,
                "principled_block_tokens": self.principled_block_tokens,
                "article_heuristic": (
                    None if self.article_heuristic is None else asdict(self.article_heuristic)
                ),
                "predicted_gain_s": self.predicted_gain_s,
                "swap_cost_s": self.swap_cost_s,
                "decided_at": self.decided_at,
                "candidates": [
                    {**asdict(c), "kernel_s_per_token": c.kernel_s_per_token}
                    for c in self.candidates
                ],
            }
        )

    def cost_of(self, block_size: int) -> CandidateCost:
        """The cost record of `block_size` (KeyError if it was not priced)."""
        for cost in self.candidates:
            if cost.block_size == block_size:
                return cost
        raise KeyError(block_size)


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
        self, snapshot: WindowSnapshot, current_block_size: int, *, now: float | None = None
    ) -> Decision:
        """The decision for the next interval, given the engine's current block size."""
        if not is_power_of_two(current_block_size):
            raise InvalidBlockSize(
                f"current block size must be a power of two, got {current_block_size!r}"
            )
        now = self._clock() if now is None else now
        with self._lock:
            return self._decide(snapshot, current_block_size, now)

    def _decide(self, snapshot: WindowSnapshot, current: int, now: float) -> Decision:
        policy, model = self.policy, self.cost_model
        prompts, outputs = snapshot.prompt_tokens, snapshot.output_tokens
        generated = int(outputs.sum())
        base = {"current_block_size": current, "samples": snapshot.count, "decided_at": now}
        if generated == 0:
            return Decision(
                block_size=current,
                prior_block_size=current,
                candidates=[],
                switch=False,
                reason=(
                    f"{snapshot.count} requests in the window generated no tokens: keep B={current}"
                ),
                **base,
            )
        mean_context = float((prompts * outputs + outputs * (outputs + 1) / 2).sum() / generated)
        optimum, prior = model.principled_block_size(mean_context)
        article = model.article_heuristic(float(snapshot.total.median))
        # A size in force that the calibration cannot price (e.g. reported by vLLM) is left
        # out: the cheapest candidate then wins without a gain-versus-cost test.
        calibrated = current in model.calibration.block_sizes
        priced = tuple(sorted({*policy.candidates, current} if calibrated else policy.candidates))
        costs = model.costs(
            prompts, outputs, shared_prefixes=snapshot.shared_prefixes, block_sizes=priced
        )
        base.update(principled_block_tokens=optimum, article_heuristic=article)
        if snapshot.count < policy.window.min_samples:
            return Decision(
                block_size=prior,
                prior_block_size=prior,
                candidates=costs,
                switch=False,
                reason=(
                    f"only {snapshot.count} of the {policy.window.min_samples} requests needed: "
                    f"keep B={current} (the prior B*={optimum:.1f} tokens suggests {prior})"
                ),
                **base,
            )
        by_size = {c.block_size: c for c in costs}
        best = min(
            (by_size[b] for b in policy.candidates),
            key=lambda c: (c.objective_s_per_token, c.block_size != current, c.block_size),
        )
        decision = {"block_size": best.block_size, "prior_block_size": prior}
        if best.block_size == current:
            reason = f"B={current} is already the cheapest candidate"
            return Decision(candidates=costs, switch=False, reason=reason, **decision, **base)
        if self._last_switch is not None and now - self._last_switch < self._min_dwell_s:
            reason = (
                f"B={best.block_size} is cheaper, but the last switch was "
                f"{now - self._last_switch:.0f} s ago (min_dwell {self._min_dwell_s:.0f} s): "
                f"keep B={current}"
            )
            return Decision(candidates=costs, switch=False, reason=reason, **decision, **base)
        if not calibrated:
            reason = (
                f"B={current} has no calibrated costs: switch to the cheapest calibrated "
                f"candidate B={best.block_size}"
            )
            return Decision(candidates=costs, switch=True, reason=reason, **decision, **base)
        gain = self._gain_s(snapshot, by_size[current], best)
        swap = model.swap_cost_s(by_size[current].capacity_tokens, current, best.block_size)
        base.update(predicted_gain_s=gain, swap_cost_s=swap)
        saving = 1 - best.objective_s_per_token / by_size[current].objective_s_per_token
        required = swap * policy.safety_factor
        if gain <= required:
            reason = (
                f"B={best.block_size} would save {gain:.3g} s over the next interval, not more "
                f"than the swap cost {swap:.3g} s x safety {policy.safety_factor:g}: "
                f"keep B={current}"
            )
            return Decision(candidates=costs, switch=False, reason=reason, **decision, **base)
        reason = (
            f"switch B={current} -> {best.block_size}: {saving:.1%} less time per token, "
            f"{gain:.3g} s saved over the next interval against a swap cost of {swap:.3g} s"
        )
        return Decision(candidates=costs, switch=True, reason=reason, **decision, **base)

    @property
    def _min_dwell_s(self) -> float:
        return self.policy.min_dwell.total_seconds()

    def _gain_s(
        self, snapshot: WindowSnapshot, current: CandidateCost, best: CandidateCost
    ) -> float:
        interval = self.policy.interval.total_seconds()
        saturated_tokens = interval / current.objective_s_per_token
        rate = snapshot.generated_tokens_per_s()
        tokens = saturated_tokens if rate is None else min(rate * interval, saturated_tokens)
        return tokens * (current.objective_s_per_token - best.objective_s_per_token)
