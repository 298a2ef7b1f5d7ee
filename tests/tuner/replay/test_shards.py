"""Time shards: cuts at interval boundaries, warm-ups, and sharded replays equal to unsharded."""

import math
from dataclasses import fields, replace
from itertools import pairwise

import numpy as np
import pytest

from blocktune.traces.synth import customer_service_day
from blocktune.tuner.config.calibration import default_calibration
from blocktune.tuner.config.defaults import DEFAULT_DAY_RATE_SCALE
from blocktune.tuner.config.policy import load_policy
from blocktune.tuner.replay.report import RESULT_KEYS
from blocktune.tuner.replay.runner import ADAPTIVE, Played, ReplayError, plan_replay, replay
from blocktune.tuner.replay.shards import merge_shards, time_shards
from blocktune.tuner.sim.simulator import Run

pytestmark = pytest.mark.slow

TOLERANCE = 5e-3
"""Sharded and unsharded metrics of the embedded day agree within 0.5% (0.08% measured)."""

COUNTS = ("block_size", "preemptions", "swaps")
COMPARED = [key for key in RESULT_KEYS[1:] if key != "replay_s"]  # replay_s: wall-clock time


@pytest.fixture(scope="module")
def day():
    return customer_service_day(0, rate_scale=DEFAULT_DAY_RATE_SCALE)


@pytest.fixture(scope="module")
def whole(day):
    """The embedded day's replay, unsharded."""
    return replay(day, load_policy("customer_service_llama8b"), default_calibration())


@pytest.fixture(scope="module")
def day_plan(day):
    return plan_replay(day, load_policy("customer_service_llama8b"), default_calibration())


def test_shards_cut_at_interval_boundaries_after_a_warm_up(day_plan):
    shards = time_shards(day_plan, 4)
    interval_s = day_plan.costs.interval_s
    arrivals = day_plan.workload.arrival_s
    policy = day_plan.policy
    assert shards[0].warmup_s == shards[0].start_s == -math.inf and shards[-1].end_s == math.inf
    owned = [int(shard.owns(arrivals).sum()) for shard in shards]
    assert sum(owned) == len(arrivals)
    assert max(owned) - min(owned) < 0.2 * len(arrivals) / 4
    for before, shard in pairwise(shards):
        assert shard.start_s == before.end_s
        assert shard.start_s % interval_s == 0 and shard.warmup_s % interval_s == 0
        assert shard.warmup_s <= shard.start_s - (policy.min_dwell.total_seconds() + interval_s)
        warm = int(((arrivals >= shard.warmup_s) & (arrivals < shard.start_s)).sum())
        assert warm >= policy.window.capacity
        assert len(shard.warmup_plan(day_plan).workload) == warm


def test_one_shard_merges_into_its_own_play(day_plan, whole):
    (shard,) = time_shards(day_plan, 1)
    assert shard.plan(day_plan).workload is day_plan.workload
    assert shard.warmup_plan(day_plan) is None
    for name, run in whole.runs.items():
        timeline = whole.timeline if name == ADAPTIVE else []
        merged = merge_shards(day_plan, [shard], [Played(run, timeline, 1.5)], [None])
        assert merged.timeline == timeline and merged.seconds == 1.5
        for part in fields(Run):
            mine, theirs = getattr(merged.run, part.name), getattr(run, part.name)
            assert np.array_equal(mine, theirs), (name, part.name)


def test_sharded_and_unsharded_replays_agree_on_the_embedded_day(day_plan, whole, replay_in_shards):
    sharded = replay_in_shards(day_plan, 3)
    assert sharded.trace == whole.trace
    for one, other in zip(whole.results, sharded.results, strict=True):
        assert one.policy == other.policy
        for key in COMPARED:
            expected, got = getattr(one, key), getattr(other, key)
            if key in COUNTS:
                assert got == expected, (one.policy, key)
            else:
                assert got == pytest.approx(expected, rel=TOLERANCE), (one.policy, key)
    # A shard's tuner first decides when its own window holds min_samples, so its decision
    # instants may sit elsewhere in an interval than the unsharded ones: compare the sizes
    # decided per interval where both decided.
    interval_s = day_plan.costs.interval_s
    mine = {p.t_s // interval_s: p.block_size for p in sharded.timeline}
    theirs = {p.t_s // interval_s: p.block_size for p in whole.timeline}
    common = mine.keys() & theirs.keys()
    assert len(common) >= 0.9 * len(theirs)
    assert all(mine[i] == theirs[i] for i in common)


def test_more_shards_than_the_trace_can_hold_is_an_error(day_plan):
    short = replace(day_plan, workload=day_plan.workload.arriving_in(0, 2 * 3600))
    with pytest.raises(ReplayError, match="cannot be cut into 100 time shards"):
        time_shards(short, 100)
