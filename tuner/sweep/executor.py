"""Replays as Dask tasks, on a local cluster of processes or on a running cluster by address.

`dask_client` connects to a scheduler by address (``tcp://HOST:PORT``) or
starts a `LocalCluster` of worker processes with one thread each: the
simulator is pure Python, so processes, not threads, run it in parallel.
`submit_replay` puts one replay on the cluster as tasks: its `ReplayPlan`
once, one `ReplayPlan.play` per static size and one for the adaptive policy,
then the oracle's schedule from the static runs and its play, and the report.
With time shards (`blocktune.tuner.replay.shards`) each policy is
played once per shard and once per shard's warm-up, then merged. A task's
inputs travel to a worker once: the request table to where the plan is built,
the plan to each worker that plays one of its policies. `track` waits for
futures behind a progress bar; closing the client (Ctrl-C leaves the
`dask_client` block) releases every task it submitted, so the scheduler
cancels those not done.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from distributed import Client, Future, LocalCluster, as_completed
from tqdm import tqdm

from blocktune.tuner.config.calibration import Calibration
from blocktune.tuner.config.policy import Policy
from blocktune.tuner.replay.runner import (
    ADAPTIVE,
    ORACLE,
    Played,
    ReplayPlan,
    plan_replay,
    policy_names,
)
from blocktune.tuner.replay.shards import Shard, merge_shards, time_shards

__all__ = ["SubmittedReplay", "dask_client", "submit_replay", "track"]


@contextmanager
def dask_client(scheduler: str | None = None, workers: int | None = None) -> Iterator[Client]:
    """A client of the cluster whose scheduler is at `scheduler`, or else of a new
    `LocalCluster` of `workers` single-threaded processes (None: one per core), which
    stops when the client closes."""
    if scheduler is not None:
        with Client(scheduler, set_as_default=False) as client:
            yield client
        return
    cluster = LocalCluster(
        n_workers=workers,
        threads_per_worker=1,
        processes=True,
        dashboard_address=":0",  # a free port: Dask's 8787 is also the sidecar's default
        silence_logs=logging.CRITICAL,
    )
    with cluster, Client(cluster, set_as_default=False) as client:
        yield client


@dataclass(frozen=True)
class SubmittedReplay:
    """A replay on the cluster: the future of its `ReplayReport` and those of its plays."""

    report: Future
    plays: list[Future]


def submit_replay(
    client: Client,
    frame: Future,
    policy: Policy,
    calibration: Calibration,
    *,
    label: str | Future,
    initial_block_size: int | None = None,
    shards: int = 1,
) -> SubmittedReplay:
    """Put a replay of the request table `frame` (a future: `client.scatter` a local one)
    under every policy of `policy` on the cluster, in `shards` time shards."""
    plan = client.submit(
        plan_replay,
        frame,
        policy,
        calibration,
        label=label,
        initial_block_size=initial_block_size,
    )
    alone = policy_names(policy)[:-1]  # the oracle follows the static runs
    if shards == 1:
        played = {
            name: client.submit(ReplayPlan.play, plan, name, priority=_priority(name))
            for name in alone
        }
        schedule = client.submit(ReplayPlan.oracle_schedule, plan, played)
        played[ORACLE] = client.submit(ReplayPlan.play_oracle, plan, schedule)
        plays = list(played.values())
    else:
        played, plays = _submit_shards(client, plan, alone, shards)
    return SubmittedReplay(client.submit(ReplayPlan.report, plan, played), plays)


def _priority(name: str) -> int:
    """The Dask priority of a play: the adaptive plays start first (their selector forecasts
    at every decision, so they take longest), the others in the order submitted."""
    return 1 if name == ADAPTIVE else 0


def _submit_shards(
    client: Client, plan: Future, alone: Sequence[str], count: int
) -> tuple[dict[str, Future], list[Future]]:
    """Per policy, the future of its merged play; and the futures of every shard's plays."""
    cuts = client.submit(time_shards, plan, count)
    shards = [client.submit(operator.getitem, cuts, k) for k in range(count)]
    parts = [client.submit(Shard.plan, shard, plan) for shard in shards]
    warmups = [client.submit(Shard.warmup_plan, shard, plan) for shard in shards[1:]]
    played, plays = {}, []

    def merged(play: Callable[..., Played], *args: object, priority: int = 0) -> Future:
        """`play(shard plan, *args)` for every shard and warm-up, and their merge."""
        whole = [client.submit(play, part, *args, priority=priority) for part in parts]
        warm = [client.submit(play, warmup, *args, priority=priority) for warmup in warmups]
        plays.extend(whole + warm)
        return client.submit(merge_shards, plan, cuts, whole, [None, *warm])

    for name in alone:
        played[name] = merged(ReplayPlan.play, name, priority=_priority(name))
    schedule = client.submit(ReplayPlan.oracle_schedule, plan, played)
    played[ORACLE] = merged(ReplayPlan.play_oracle, schedule)
    return played, plays


def track(client: Client, futures: Sequence[Future], *, desc: str, progress: bool = True) -> None:
    """Wait until every future is done or failed, behind a tqdm bar. On Ctrl-C the
    `KeyboardInterrupt` goes on up: closing the client then cancels what it submitted."""
    with tqdm(total=len(futures), desc=desc, unit="task", disable=not progress) as bar:
        for _ in as_completed(futures, loop=client.loop):
            bar.update()
