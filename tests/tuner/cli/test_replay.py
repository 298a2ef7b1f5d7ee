"""`blocktune replay` on the command line: table, report.json, plots, trace files, errors."""

import json
from pathlib import Path

import pytest

from blocktune.tuner.cli import main
from blocktune.tuner.replay.report import RESULT_KEYS

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
POLICIES = ("static-8", "static-16", "static-32", "static-64", "adaptive", "oracle")
SMALL_DAY = ("--rate-scale", "0.005")  # about 800 requests


@pytest.fixture(scope="module")
def policy_file(analytic_policy_file) -> str:
    return analytic_policy_file("customer_service_llama8b")


def test_embedded_day_table_report_and_plots(capsys, tmp_path, policy_file):
    out, extra = tmp_path / "out", tmp_path / "copy.json"
    args = ["replay", "--policy", policy_file, *SMALL_DAY, "--out", str(out), "--json", str(extra)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert lines[0].startswith("trace: synthetic customer-service day (seed 0, 86400 s")
    assert "KV budget 3.5 GiB, candidates 8 16 32 64" in lines[1]
    assert lines[3].split()[:4] == ["policy", "B", "goodput", "tok/s"]
    assert [line.split()[0] for line in lines[5:11]] == list(POLICIES)
    assert "goal: capacity, scored in a replay as SLO goodput" in printed
    assert "adaptive on the goal: " in printed and "x the best static size" in printed
    assert "peak KV" in printed and "the source article claims -19% peak memory" in printed
    assert "adaptive: starts at B=16" in printed
    report = json.loads((out / "report.json").read_text())
    assert report == json.loads(extra.read_text())
    assert [r["policy"] for r in report["results"]] == list(POLICIES)
    assert all(tuple(r) == RESULT_KEYS for r in report["results"])
    assert report["policy"]["deployment"] == "customer-service-llama8b"
    for name in ("lengths_over_time.png", "adaptive_timeline.png", "policies.png"):
        assert (out / name).read_bytes().startswith(b"\x89PNG")


def test_json_to_stdout_instead_of_the_table(capsys, policy_file):
    assert main(["replay", "synthetic", "--policy", policy_file, *SMALL_DAY, "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["trace"]["label"].startswith("synthetic customer-service day")
    assert report["trace"]["requests"] == report["trace"]["replayed"] > 500
    assert {r["block_size"] for r in report["results"]} == {8, 16, 32, 64, None}


def test_a_trace_file_with_mapped_columns(capsys, tmp_path, policy_file):
    trace = tmp_path / "logs.csv"
    rows = [f"{i * 0.5},{40 + i % 7},{10 + i % 5}" for i in range(200)]
    trace.write_text("ts,in,out\n" + "\n".join(rows) + "\n")
    args = ["replay", str(trace), "--time-col", "ts", "--prompt-col", "in", "--output-col", "out"]
    assert main([*args, "--policy", policy_file, "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["trace"]["label"] == "logs.csv (format csv)"
    assert report["trace"]["replayed"] == 200
    assert report["trace"]["duration_s"] == pytest.approx(99.5)


def test_a_lengths_file_needs_a_rate(capsys, tmp_path, policy_file):
    trace = tmp_path / "lengths.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n" + "30,20\n" * 50)
    assert main(["replay", str(trace), "--policy", policy_file]) == 2
    assert "give a rate" in capsys.readouterr().err
    assert main(["replay", str(trace), "--rate", "2", "--policy", policy_file]) == 0
    assert "lengths.csv (format lengths): 50 requests" in capsys.readouterr().out


def test_flags_that_do_not_apply_or_replace_the_input_are_named(capsys, tmp_path, policy_file):
    trace = tmp_path / "logs.csv"
    trace.write_text("ts,in,out\n" + "".join(f"{i},{30 + i},{10}\n" for i in range(60)))
    mapped = ["--time-col", "ts", "--prompt-col", "in", "--output-col", "out"]
    for flag in ("--rate-scale", "--duration"):
        assert main(["replay", str(trace), *mapped, flag, "2", "--policy", policy_file]) == 2
        assert f"{flag} changes the embedded day only" in capsys.readouterr().err
    (tmp_path / "timed.csv").write_text(trace.read_text().replace("ts,", "arrival_s,"))
    args = ["replay", str(tmp_path / "timed.csv"), "--prompt-col", "in", "--output-col", "out"]
    assert main([*args, "--rate", "4", "--policy", policy_file]) == 0
    assert (
        "warning: the rate of 4 requests/s replaces the trace's own arrival times "
        "(column 'arrival_s') with Poisson arrivals" in capsys.readouterr().err
    )


def test_errors_name_the_problem(capsys, tmp_path, policy_file):
    assert main(["replay", "--policy", str(tmp_path / "none.yaml")]) == 2
    assert "none.yaml" in capsys.readouterr().err
    assert main(["replay", str(tmp_path / "missing.csv"), "--policy", policy_file]) == 2
    assert "missing.csv" in capsys.readouterr().err
    args = ["replay", "--policy", policy_file, *SMALL_DAY, "--initial-block-size", "128"]
    assert main(args) == 2
    assert "initial block size 128 is not among" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["replay", "--rate-scale", "0"])
    assert exit_info.value.code == 2
    assert "must be a positive number" in capsys.readouterr().err


def test_a_span_the_interval_bins_cannot_hold_is_refused(capsys, tmp_path, policy_file):
    trace = tmp_path / "stray.csv"
    rows = [f"{1000 + i * 0.5},{40 + i % 7},{10 + i % 5}" for i in range(200)] + ["-1e12,40,10"]
    trace.write_text("ts,in,out\n" + "\n".join(rows) + "\n")
    args = ["replay", str(trace), "--time-col", "ts", "--prompt-col", "in", "--output-col", "out"]
    assert main([*args, "--policy", policy_file]) == 2
    error = capsys.readouterr().err
    assert "the last request arrives 1e+12 s into the trace" in error
    assert "a replay holds at most 1,000,000" in error
    assert "the widest gap, 1e+12 s, follows the request at 0 s" in error
