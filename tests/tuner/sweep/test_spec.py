"""Sweep specs: traces x policies x grid settings, and every problem with its file, line and key."""

import shutil
from pathlib import Path

import pytest

from blocktune.tuner.config.calibration import (
    ANALYTIC_FILE,
    bundled_files,
    default_calibration,
    load_calibration,
)
from blocktune.tuner.config.config_files import ConfigError
from blocktune.tuner.config.policy import load_policy, policy_path
from blocktune.tuner.replay.inputs import TraceInput
from blocktune.tuner.sweep.spec import AS_WRITTEN, load_sweep

POLICY = "customer_service_llama8b"


def write(folder: Path, text: str, name: str = "sweep.yaml") -> Path:
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def logs(tmp_path) -> Path:
    folder = tmp_path / "logs"
    folder.mkdir()
    for name in ("day1.csv", "day2.csv", "notes.txt"):
        (folder / name).write_text("arrival_s,prompt_tokens,output_tokens\n0,10,5\n")
    return folder


def test_a_spec_expands_to_every_trace_policy_and_setting(tmp_path, logs):
    local = write(tmp_path, policy_path(POLICY).read_text(encoding="utf-8"), "mine.yaml")
    spec = write(
        tmp_path,
        f"""\
traces:
  - {{path: logs/day*.csv, format: csv, shards: 3}}
  - {{path: synthetic, seed: 4, rate_scale: 0.01}}
policies: [{POLICY}, {local.name}]
grid:
  kv_budget: [96MiB, 3.5GiB]
  interval: [1m, 5m]
""",
    )
    points = load_sweep(spec)
    assert len(points) == 3 * 2 * 4
    assert list(dict.fromkeys(p.trace for p in points)) == [
        "logs/day1.csv",
        "logs/day2.csv",
        "synthetic customer-service day (seed 4, 86400 s, rate scale 0.01)",
    ]
    first = points[0]
    assert first.source == TraceInput(path=str(logs / "day1.csv"), format="csv")
    assert first.shards == 3 and points[-1].shards == 1
    assert points[-1].source == TraceInput(path="synthetic", seed=4, rate_scale=0.01)
    assert [p.setting for p in points[:4]] == [
        "kv_budget=96MiB, interval=1m",
        "kv_budget=96MiB, interval=5m",
        "kv_budget=3.5GiB, interval=1m",
        "kv_budget=3.5GiB, interval=5m",
    ]
    assert [p.policy.kv_budget for p in points[:4]] == [96 * 2**20] * 2 + [int(3.5 * 2**30)] * 2
    assert [p.policy.interval.total_seconds() for p in points[:2]] == [60, 300]
    assert {p.policy_name for p in points} == {POLICY, "mine.yaml"}
    assert points[0].policy.window == load_policy(POLICY).window
    assert points[0].calibration == default_calibration()


def test_without_a_grid_each_policy_is_replayed_as_written(tmp_path):
    spec = write(tmp_path, f"traces: [{{path: synthetic}}]\npolicies: [{POLICY}, default]\n")
    points = load_sweep(spec)
    assert [(p.policy_name, p.setting) for p in points] == [
        (POLICY, AS_WRITTEN),
        ("default", AS_WRITTEN),
    ]
    assert points[0].policy == load_policy(POLICY)


def test_a_section_value_replaces_the_policy_section(tmp_path):
    grid = "grid:\n  window:\n    - {capacity: 500, min_samples: 50}\n  candidates: [[16, 32]]\n"
    spec = write(tmp_path, f"traces: [{{path: synthetic}}]\npolicies: [{POLICY}]\n{grid}")
    (point,) = load_sweep(spec)
    assert point.setting == "candidates=[16, 32], window={capacity: 500, min_samples: 50}"
    assert point.policy.window.capacity == 500 and point.policy.window.min_samples == 50
    assert point.policy.candidates == (16, 32)


def test_grid_calibrations_start_at_the_spec_folder(tmp_path):
    analytic = next(path for path in bundled_files() if path.name == ANALYTIC_FILE)
    shutil.copy(analytic, tmp_path / "l4.yaml")
    grid = "grid:\n  calibration: [default, l4.yaml]\n"
    spec = write(tmp_path, f"traces: [{{path: synthetic}}]\npolicies: [{POLICY}]\n{grid}")
    points = load_sweep(spec)
    assert [p.setting for p in points] == ["calibration=default", "calibration=l4.yaml"]
    assert points[0].calibration == default_calibration()
    assert points[1].calibration == load_calibration(tmp_path / "l4.yaml")


def test_every_problem_is_reported_with_file_line_and_key_path(tmp_path, logs):
    spec = write(
        tmp_path,
        f"""\
traces:
  - {{path: logs/*.parquet}}
  - {{path: logs/day1.csv, rate_scale: 2}}
  - {{path: synthetic, format: azure}}
policies: [{POLICY}, nonesuch]
grid:
  kv_budget: [96MiB, 3.5GiBB]
  block_size: [16]
""",
    )
    with pytest.raises(ConfigError) as caught:
        load_sweep(spec)
    problems = caught.value.problems
    assert len(problems) == 6
    found = dict(problem.split(": ", 2)[:2][::-1] for problem in problems)
    assert found == {
        "traces[0].path": f"{spec}:2",
        "traces[1]": f"{spec}:3",
        "traces[2]": f"{spec}:4",
        "policies[1]": f"{spec}:5",
        "grid.kv_budget[1]": f"{spec}:7",
        "grid.block_size": f"{spec}:8",
    }
    text = "\n".join(problems)
    assert "no trace file matches 'logs/*.parquet'" in text
    assert "rate_scale: only for path 'synthetic' (the embedded day)" in text
    assert "format: only for trace files" in text
    assert "no bundled policy of that name" in text
    assert "3.5GiBB" in text


def test_a_setting_that_makes_a_policy_invalid_is_named(tmp_path):
    spec = write(
        tmp_path,
        f"traces: [{{path: synthetic}}]\npolicies: [{POLICY}]\ngrid:\n  kv_budget: [1MiB, 1GiB]\n",
    )
    with pytest.raises(ConfigError) as caught:
        load_sweep(spec)
    (problem,) = caught.value.problems
    assert problem.startswith(f"{spec}:3: grid: kv_budget=1MiB makes policy {POLICY} invalid: ")
    assert "holds no block of the largest candidate" in problem
