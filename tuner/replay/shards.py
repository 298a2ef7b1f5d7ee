"""Time shards: one long replay cut into pieces that run in parallel, each after a warm-up.

`time_shards` cuts a replay's requests at decision-interval boundaries into
shards of about equal request counts. A shard owns the requests arriving in
``[start_s, end_s)``; before them it replays those arriving from `warmup_s`
on, so that its server and its tuner are warm at its start, and then drops
their results. The warm-up reaches back to the earlier of

- ``policy.min_dwell + policy.interval`` before the cut: the adaptive tuner has
  had a whole dwell of decisions, so it can have switched to the size it
  prefers, and
- the arrival of the ``policy.window.capacity``-th request before the cut: its
  length window is as full as in the unsharded replay,

rounded down to an interval boundary. A shard's tuner decides first once its
warm-up window holds `min_samples` requests and every interval after, so its
decisions fall in the same intervals as the unsharded replay's, at their own
phase within an interval (the last one may fall after the trace's end). The
server's queue and KV cache then hold what they would, except for a backlog
older than the warm-up (a trace the server cannot keep up with): sharding
suits the loads a server serves.

`merge_shards` joins the shards' `Played` of one policy into the `Played` of
the whole replay: each request's times come from the shard that owns it;
switches and timeline points are those made in owned time (and where a shard
starts at another size than the previous one ended at, a switch at its start,
so the sizes in force are the simulated ones; `swaps` counts them too); peaks
are the largest of any shard; the counters a run integrates (steps,
preemptions, KV byte-seconds, slot-steps, busy and pause seconds) are each
shard's minus those of its warm-up replayed alone, i.e. what its own requests
added. `Shard.plan` and `Shard.warmup_plan` are the two `ReplayPlan` a shard
plays per policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from itertools import pairwise

import numpy as np

from blocktune.tuner.replay.runner import Played, ReplayError, ReplayPlan
from blocktune.tuner.sim.simulator import Run

__all__ = ["Shard", "merge_shards", "time_shards"]


@dataclass(frozen=True)
class Shard:
    """The requests arriving in [start_s, end_s) are the shard's own; it replays those from
    `warmup_s` on (the first shard starts at -inf, the last ends at +inf)."""

    warmup_s: float
    start_s: float
    end_s: float

    def plan(self, plan: ReplayPlan) -> ReplayPlan:
        """The shard's part of `plan`: its requests and the warm-up's, with the whole
        replay's interval costs."""
        return replace(plan, workload=plan.workload.arriving_in(self.warmup_s, self.end_s))

    def warmup_plan(self, plan: ReplayPlan) -> ReplayPlan | None:
        """The warm-up's requests alone (None for the first shard, which has no warm-up)."""
        if self.start_s == -math.inf:
            return None
        return replace(plan, workload=plan.workload.arriving_in(self.warmup_s, self.start_s))

    def owns(self, times: np.ndarray) -> np.ndarray:
        return (times >= self.start_s) & (times < self.end_s)


def time_shards(plan: ReplayPlan, count: int) -> list[Shard]:
    """`count` shards of `plan`'s requests with their warm-ups (see the module docstring)."""
    arrivals = plan.workload.arrival_s
    interval_s = plan.costs.interval_s
    policy = plan.policy
    dwell_s = policy.min_dwell.total_seconds() + interval_s
    rows = [len(arrivals) * k // count for k in range(1, count)]
    cuts = [math.floor(arrivals[row] / interval_s) * interval_s for row in rows]
    edges = [float(arrivals[0]), *cuts, math.inf]
    if any(end <= start for start, end in pairwise(edges)):
        raise ReplayError(
            f"{plan.label}: {len(arrivals)} requests over {len(plan.costs.tokens)} intervals "
            f"of {interval_s:g} s cannot be cut into {count} time shards"
        )
    shards = [Shard(-math.inf, -math.inf, edges[1])]
    for cut, end in zip(cuts, edges[2:], strict=True):
        before = int(np.searchsorted(arrivals, cut)) - policy.window.capacity
        reach = min(cut - dwell_s, float(arrivals[max(before, 0)]))
        shards.append(Shard(math.floor(reach / interval_s) * interval_s, cut, end))
    return shards


def merge_shards(
    plan: ReplayPlan, shards: list[Shard], parts: list[Played], warmups: list[Played | None]
) -> Played:
    """One policy's `Played` over the whole of `plan` from its `Played` per shard and that of
    each shard's warm-up alone (None for the first shard, which has none)."""
    own, switches, timeline = [], [], []
    for shard, part in zip(shards, parts, strict=True):
        run = part.run
        rows = shard.owns(shard.plan(plan).workload.arrival_s)
        own.append((run.first_token_s[rows], run.finish_s[rows], run.generated[rows]))
        size = _size_at(run, shard.start_s)
        if size != (switches[-1][2] if switches else parts[0].run.block_size):
            switches.append((int(shard.start_s // plan.costs.interval_s), shard.start_s, size))
        switches += [s for s in run.switches if shard.start_s <= s[1] < shard.end_s]
        timeline += [p for p in part.timeline if shard.start_s <= p.t_s < shard.end_s]
    runs = [part.run for part in parts]
    alone = [None if warmup is None else warmup.run for warmup in warmups]

    def added(name: str) -> float:
        """What the shards' own requests added to the counter `name`."""
        return sum(
            getattr(run, name) - (0 if warmup is None else getattr(warmup, name))
            for run, warmup in zip(runs, alone, strict=True)
        )

    first_token, finish, generated = (np.concatenate(column) for column in zip(*own, strict=True))
    merged = Run(
        block_size=runs[0].block_size,
        first_token_s=first_token,
        finish_s=finish,
        generated=generated,
        steps=added("steps"),
        preemptions=added("preemptions"),
        swaps=len(switches),
        swap_pause_s=added("swap_pause_s"),
        peak_kv_bytes=max(run.peak_kv_bytes for run in runs),
        peak_blocks=max(run.peak_blocks for run in runs),
        kv_byte_s=added("kv_byte_s"),
        allocated_slot_steps=added("allocated_slot_steps"),
        used_slot_steps=added("used_slot_steps"),
        busy_s=added("busy_s"),
        switches=switches,
        prefix_hit_tokens=added("prefix_hit_tokens"),
    )
    seconds = sum(p.seconds for p in parts) + sum(w.seconds for w in warmups if w is not None)
    return Played(merged, timeline, seconds)


def _size_at(run: Run, t: float) -> int:
    """The block size in force in `run` at time `t`."""
    earlier = [size for _, when, size in run.switches if when < t]
    return earlier[-1] if earlier else run.block_size
