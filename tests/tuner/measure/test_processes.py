"""Timings in worker processes: results in task order, and a worker that dies is an error
that says what happened."""

import os
from types import SimpleNamespace

import pytest

from blocktune.tuner.cli import main
from blocktune.tuner.measure.processes import WorkerProcessLost, map_in_processes


def test_results_come_back_in_the_order_of_the_tasks():
    assert map_in_processes(abs, [-3, 2, -1, 5], jobs=2, threads=1) == [3, 2, 1, 5]


def test_a_worker_process_that_dies_is_reported_as_lost():
    # os._exit ends the worker at once, as the system's out-of-memory killer does.
    with pytest.raises(WorkerProcessLost, match="most often for want of memory"):
        map_in_processes(os._exit, [3, 3], jobs=2, threads=1)


def test_validate_says_a_worker_was_lost_and_what_to_try(monkeypatch, capsys):
    from blocktune.tuner.cli import validate as validate_command
    from blocktune.tuner.fidelity import validation

    def lost(*args, **kwargs):
        raise WorkerProcessLost("a worker process (one of 2) ended without its result")

    engine = SimpleNamespace(clock="cpu", block_size_verdict=lambda: "")
    calibration = SimpleNamespace(engine=engine, describe=lambda: "a calibration")
    monkeypatch.setattr(validate_command, "_engine_calibration", lambda *args: (calibration, None))
    monkeypatch.setattr(validation, "validate", lost)
    assert main(["validate", "--requests", "5", "--model", "tiny-random"]) == 1
    err = capsys.readouterr().err
    assert "error: a worker process (one of 2) ended without its result" in err
    assert "--jobs 1" in err and "Traceback" not in err
