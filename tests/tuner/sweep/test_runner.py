"""`blocktune sweep` on Dask (a LocalCluster, and `dask scheduler` / `dask worker` processes on
loopback), equal to single replays; `blocktune replay --jobs` equal to a serial replay."""

import json
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
import yaml
from distributed import Client

from blocktune.traces.synth import customer_service_day
from blocktune.tuner.cli import main
from blocktune.tuner.config.calibration import default_calibration
from blocktune.tuner.config.policy import load_policy, policy_path
from blocktune.tuner.replay.report import RESULT_KEYS
from blocktune.tuner.replay.runner import plan_replay
from blocktune.tuner.sweep.executor import dask_client, submit_replay, track

pytestmark = pytest.mark.slow

POLICY = "customer_service_llama8b"
BUDGETS = ("96MiB", "3.5GiB")
SMALL = ("--duration", "7200", "--rate-scale", "0.01")  # about 1,600 requests in 2 hours
START_S = 90
COMPARED = [key for key in RESULT_KEYS[1:] if key != "replay_s"]  # replay_s: wall-clock time


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """Two small trace files, a spec sweeping them over two KV budgets, and a policy file per
    budget for the single replays."""
    folder = tmp_path_factory.mktemp("sweep")
    for seed in (1, 2):
        out = str(folder / f"day{seed}.csv")
        assert main(["trace", "synth", "--out", out, "--seed", str(seed), *SMALL]) == 0
    policy = yaml.safe_load(policy_path(POLICY).read_text(encoding="utf-8"))
    for budget in BUDGETS:
        text = yaml.safe_dump({**policy, "kv_budget": budget})
        (folder / f"policy-{budget}.yaml").write_text(text, encoding="utf-8")
    spec = {"traces": [{"path": "day*.csv"}], "policies": [POLICY], "grid": {"kv_budget": BUDGETS}}
    (folder / "sweep.yaml").write_text(yaml.safe_dump(spec), encoding="utf-8")
    return folder


def single_replay(capsys, trace: Path, policy: Path) -> list[dict]:
    capsys.readouterr()
    assert main(["replay", str(trace), "--policy", str(policy), "--jobs", "1", "--json", "-"]) == 0
    return json.loads(capsys.readouterr().out)["results"]


def assert_rows_equal_single_replays(capsys, folder: Path, out: Path) -> None:
    rows = pd.read_parquet(out / "results.parquet")
    assert list(rows.columns[:4]) == ["trace", "policy", "setting", "replay_policy"]
    assert len(rows) == 2 * len(BUDGETS) * 6
    for trace in ("day1.csv", "day2.csv"):
        for budget in BUDGETS:
            point = rows[(rows.trace == trace) & (rows.setting == f"kv_budget={budget}")]
            expected = single_replay(capsys, folder / trace, folder / f"policy-{budget}.yaml")
            assert list(point.replay_policy) == [result["policy"] for result in expected]
            assert (point.policy == POLICY).all()
            for (_, row), result in zip(point.iterrows(), expected, strict=True):
                for key in COMPARED:
                    got = None if pd.isna(row[key]) else row[key]
                    assert got == result[key], (trace, budget, result["policy"], key)


@pytest.mark.timeout(300)
def test_a_sweep_on_a_local_cluster_equals_single_replays(capsys, folder, tmp_path):
    out = tmp_path / "out"
    spec = str(folder / "sweep.yaml")
    assert main(["sweep", spec, "--workers", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "with 2 workers" in printed
    summary = [line.split() for line in printed.splitlines() if f" {POLICY} " in line]
    assert [line[:3] for line in summary] == [["day1.csv", POLICY, "capacity"]] + [
        ["day2.csv", POLICY, "capacity"]
    ]
    assert sorted(p.name for p in out.iterdir()) == ["goal-1.png", "goal-2.png", "results.parquet"]
    assert_rows_equal_single_replays(capsys, folder, out)


def started(command: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


@pytest.mark.timeout(300)
def test_a_sweep_on_a_running_cluster_by_address(capsys, folder, tmp_path):
    """`dask scheduler` on a free loopback port (port 0: the system picks it, the scheduler
    file tells it) and two `dask worker` processes; a broken trace fails alone."""
    (folder / "broken.csv").write_text("arrival_s,prompt_tokens\n0,12\n", encoding="utf-8")
    spec = yaml.safe_load((folder / "sweep.yaml").read_text(encoding="utf-8"))
    spec["traces"].append({"path": "broken.csv"})
    (folder / "with-broken.yaml").write_text(yaml.safe_dump(spec), encoding="utf-8")
    dask = [sys.executable, "-m", "dask"]
    address_file = tmp_path / "scheduler.json"
    processes = [
        started(
            [*dask, "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard"]
            + ["--scheduler-file", str(address_file), "--idle-timeout", "600"],
            tmp_path,
        )
    ]
    try:
        deadline = time.monotonic() + START_S
        while not address_file.exists():
            assert processes[0].poll() is None, processes[0].stderr.read().decode()
            assert time.monotonic() < deadline, "the scheduler did not start"
            time.sleep(0.2)
        address = json.loads(address_file.read_text())["address"]
        assert address.startswith("tcp://127.0.0.1:")
        worker = [*dask, "worker", address, "--host", "127.0.0.1", "--nthreads", "1"]
        worker += ["--no-dashboard", "--death-timeout", "60"]
        processes += [started(worker, tmp_path) for _ in range(2)]
        with Client(address, timeout=START_S, set_as_default=False) as client:
            client.wait_for_workers(2, timeout=START_S)
        out = tmp_path / "out"
        argv = [
            "sweep",
            str(folder / "with-broken.yaml"),
            "--scheduler",
            address,
            "--out",
            str(out),
        ]
        assert main(argv) == 1
    finally:
        stop(processes)
    printed = capsys.readouterr()
    assert f"cluster: {address} with 2 workers" in printed.out
    failures = [line for line in printed.err.splitlines() if line.startswith("failed: ")]
    assert [line.split(": TraceError: ")[0] for line in failures] == [
        f"failed: trace broken.csv, policy {POLICY}, setting kv_budget={budget}"
        for budget in BUDGETS
    ]
    assert all("missing column 'output_tokens'" in line for line in failures)
    assert_rows_equal_single_replays(capsys, folder, out)


@pytest.mark.timeout(300)
def test_replay_jobs_gives_the_tables_of_a_serial_replay(capsys, tmp_path):
    reports = {}
    tables = {}
    for jobs in ("1", "2"):
        out = tmp_path / jobs
        args = ["replay", "--policy", POLICY, *SMALL, "--jobs", jobs, "--out", str(out)]
        assert main(args) == 0
        printed = capsys.readouterr().out.splitlines()
        start = next(i for i, line in enumerate(printed) if line.startswith("policy "))
        # the last column is each policy's wall-clock replay time
        tables[jobs] = [line.rsplit(None, 1)[0] for line in printed[start : start + 8]]
        tables[jobs] += printed[start + 8 : -1]
        reports[jobs] = json.loads((out / "report.json").read_text())
    assert tables["1"] == tables["2"]
    assert tables["1"][2].startswith("static-8 ") and tables["1"][7].startswith("oracle ")
    for report in reports.values():
        for result in report["results"]:
            result.pop("replay_s", None)
    assert reports["1"] == reports["2"]


@pytest.mark.timeout(120)
def test_ctrl_c_cancels_a_sweep_cleanly(folder, tmp_path):
    spec = {
        "traces": [{"path": "synthetic", "rate_scale": 0.2}],
        "policies": [POLICY],
        "grid": {"kv_budget": ["1GiB", "2GiB", "3GiB", "4GiB"]},
    }
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec), encoding="utf-8")
    command = [sys.executable, "-m", "blocktune.tuner.cli", "sweep", "sweep.yaml"]
    # The sweep must start with SIGINT at its default: one that pytest inherited as ignored
    # (started as a script's background job, or by a runner that ignores it) passes on to
    # its children, and Python then never raises KeyboardInterrupt.
    process = subprocess.Popen(
        [*command, "--workers", "1"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        for line in process.stdout:
            if line.startswith(b"cluster: "):
                break
        time.sleep(1)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130
    assert b"cancelled" in err and b"Traceback" not in err
    assert not (tmp_path / "sweep-out").exists()


@pytest.mark.timeout(300)
def test_time_shards_run_as_tasks_like_in_one_process(replay_in_shards):
    day = customer_service_day(3, duration_s=10800, rate_scale=0.02)
    policy, calibration = load_policy(POLICY), default_calibration()
    expected = replay_in_shards(plan_replay(day, policy, calibration, label="day"), 3)
    with dask_client(workers=2) as client:
        frame = client.scatter(day)
        submitted = submit_replay(client, frame, policy, calibration, label="day", shards=3)
        track(client, submitted.plays, desc="shards", progress=False)
        report = submitted.report.result()
    assert len(submitted.plays) == 6 * (3 + 2)
    assert [replace(r, replay_s=0) for r in report.results] == [
        replace(r, replay_s=0) for r in expected.results
    ]
