"""Run independent timings in worker processes, one core each: `map_in_processes`.

`blocktune validate` times calibration points and serves live runs that do not
depend on each other. With `jobs` above 1 they go to that many worker processes
(spawned, each with `threads` torch threads), so a machine with two idle cores
does them in half the time; each worker times its own steps, by its own thread's
clock. With one job they run here, in order.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import TypeVar

__all__ = ["DEFAULT_JOBS", "WorkerProcessLost", "default_jobs", "map_in_processes"]

DEFAULT_JOBS = 2
"""Worker processes by default (at most the machine's cores): both cores of a 2-core CPU."""


class WorkerProcessLost(RuntimeError):
    """A worker process ended without returning its result: the system killed it (most
    often for want of memory) or it crashed."""


Task = TypeVar("Task")
Result = TypeVar("Result")


def default_jobs() -> int:
    """`DEFAULT_JOBS`, or fewer on a machine with fewer cores."""
    return max(1, min(DEFAULT_JOBS, os.cpu_count() or 1))


def map_in_processes(
    function: Callable[[Task], Result],
    tasks: Iterable[Task],
    *,
    jobs: int,
    threads: int,
    done: Callable[[int, int], None] = lambda finished, total: None,
) -> list[Result]:
    """`[function(task) for task in tasks]`, in `jobs` processes with `threads` torch threads
    each (here when `jobs` is 1). `function` and the tasks must pickle (a module-level
    function, plain data, models). `done(finished, total)` is called as tasks finish.
    Raises `WorkerProcessLost` when a worker process dies before it returns."""
    tasks = list(tasks)
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    if jobs == 1 or len(tasks) < 2:
        results = []
        for task in tasks:
            results.append(function(task))
            done(len(results), len(tasks))
        return results
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool

    context = multiprocessing.get_context("spawn")  # no fork of a process that runs torch
    with ProcessPoolExecutor(
        min(jobs, len(tasks)), mp_context=context, initializer=_set_threads, initargs=(threads,)
    ) as pool:
        futures = {pool.submit(function, task): i for i, task in enumerate(tasks)}
        results: list = [None] * len(tasks)
        try:
            for finished, future in enumerate(as_completed(futures), start=1):
                results[futures[future]] = future.result()
                done(finished, len(tasks))
        except BrokenProcessPool as error:
            raise WorkerProcessLost(
                f"a worker process (one of {min(jobs, len(tasks))}) ended without its result: "
                "the system killed it, most often for want of memory, or it crashed"
            ) from error
    return results


def _set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
