"""The selector's decision for the requests of a trace table, as `blocktune recommend` prints it."""

from __future__ import annotations

import pandas as pd

from blocktune.tuner.config.calibration import Calibration
from blocktune.tuner.config.defaults import DEFAULT_BLOCK_SIZE
from blocktune.tuner.config.policy import Policy
from blocktune.tuner.core.selector import Decision, Selector
from blocktune.tuner.sim.step_cost import StepCostModel
from blocktune.tuner.sim.window import LengthWindow, WindowSnapshot

__all__ = ["RecommendError", "recommend"]


class RecommendError(ValueError):
    """A request to `recommend` that cannot be served (for example an empty selection)."""


def recommend(
    frame: pd.DataFrame,
    policy: Policy,
    calibration: Calibration,
    *,
    current_block_size: int = DEFAULT_BLOCK_SIZE,
    last: int | None = None,
) -> tuple[Decision, WindowSnapshot, int]:
    """The selector's decision for the requests of `frame` (arrival_s, prompt_tokens,
    output_tokens, optional prefix_group), all of them or the `last` ones, with the
    number of requests left out because no candidate's KV pool could ever hold them. The
    forecast's sample (the selection's latest requests) is replayed at the whole selection's
    rate, so a capacity is a multiple of the selection's load (the one a check replays)."""
    rows = frame if last is None else frame.tail(last)
    if rows.empty:
        raise RecommendError("the trace selection holds no requests")
    slots = StepCostModel(policy, calibration).capacity_slots
    fits = min(slots(b) for b in policy.candidates)
    keep = (rows["prompt_tokens"] + rows["output_tokens"]) <= fits
    rows = rows[keep]
    if rows.empty:
        raise RecommendError(f"every request is longer than the KV pool ({fits} token slots)")
    window = LengthWindow(capacity=len(rows))
    groups = None
    if "prefix_group" in rows:
        groups = [None if pd.isna(g) else g for g in rows["prefix_group"]]
    window.observe_many(
        rows["prompt_tokens"].to_numpy(),
        rows["output_tokens"].to_numpy(),
        timestamps=rows["arrival_s"].to_numpy(),
        prefix_groups=groups,
    )
    snapshot = window.snapshot()
    decision = Selector(policy, calibration).decide(
        snapshot, current_block_size, now=0.0, at_window_rate=True
    )
    return decision, snapshot, int((~keep).sum())
