"""`blocktune trace summary` and `blocktune trace synth`."""

import json

import pandas as pd
import pytest

from blocktune.tuner.cli import main

BAD_TRACE = "arrival_s,prompt_tokens,output_tokens\n0,10,4\n1,-2,4\n2,20,0\n3,30,4\n4,x,4\n5,40,8\n"


def summary_rows(out):
    """The percentile table: {row name: [min, p50, p90, p99, max, mean]}."""
    table = {}
    for line in out.splitlines():
        cells = line.split()
        if cells and cells[0] in ("prompt", "output", "total"):
            table[cells[0]] = [float(c) for c in cells[1:]]
    return table


def test_summary_prints_counts_skips_and_percentiles(tmp_path, capsys):
    path = tmp_path / "t.csv"
    path.write_text(BAD_TRACE)
    assert main(["trace", "summary", str(path)]) == 0
    out = capsys.readouterr().out
    assert "(format csv)" in out
    assert "rows: 6 read, 3 kept, 3 skipped" in out
    assert "skipped negative_length: 1 (first at lines 3)" in out
    assert "skipped non_integer_length: 1 (first at lines 6)" in out
    assert "skipped zero_length: 1 (first at lines 4)" in out
    rows = summary_rows(out)
    kept = pd.Series([10, 30, 40])
    assert rows["prompt"][0] == kept.min() and rows["prompt"][4] == kept.max()
    assert rows["prompt"][1] == kept.median()
    assert rows["total"][5] == pytest.approx((kept + pd.Series([4, 4, 8])).mean(), abs=0.05)


def test_summary_strict_stops_with_file_line_and_column(tmp_path, capsys):
    path = tmp_path / "t.csv"
    path.write_text(BAD_TRACE)
    assert main(["trace", "summary", str(path), "--strict"]) == 2
    err = capsys.readouterr().err
    assert "t.csv, line 3, column 'prompt_tokens': negative length (value: '-2')" in err


def test_summary_with_mapping_flags_and_a_rate(tmp_path, capsys):
    path = tmp_path / "log.jsonl"
    path.write_text('{"in": 5, "out": 7}\n{"in": 9, "out": 1}\n')
    argv = ["trace", "summary", str(path), "--prompt-col", "in", "--output-col", "out"]
    assert main([*argv, "--rate", "2"]) == 0
    out = capsys.readouterr().out
    assert "(format jsonl)" in out and "rows: 2 read, 2 kept, 0 skipped" in out
    assert summary_rows(out)["prompt"][:2] == [5, 7]
    assert main(argv) == 2
    assert "missing column 'arrival_s'" in capsys.readouterr().err


def test_summary_reports_unreadable_files_without_a_traceback(tmp_path, capsys):
    assert main(["trace", "summary", str(tmp_path / "missing.csv")]) == 2
    assert "missing.csv: cannot read the trace" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["trace", "summary", str(tmp_path), "--format", "xml"])


@pytest.mark.parametrize("name", ["day.csv", "day.jsonl", "day.parquet"])
def test_synth_writes_the_day_and_summary_reads_it(tmp_path, capsys, name):
    out_path = tmp_path / name
    argv = ["trace", "synth", "--out", str(out_path), "--duration", "600", "--rate-scale", "0.01"]
    assert main([*argv, "--seed", "3"]) == 0
    written = capsys.readouterr().out
    requests = int(written.split()[1])
    assert f"to {out_path} as {name.split('.')[1]}" in written
    assert main(["trace", "summary", str(out_path)]) == 0
    out = capsys.readouterr().out
    assert f"rows: {requests} read, {requests} kept, 0 skipped" in out
    assert "prefix groups: 8" in out


def test_synth_rejects_an_unknown_extension_and_bad_scaling(tmp_path, capsys):
    assert main(["trace", "synth", "--out", str(tmp_path / "day.xlsx")]) == 2
    assert "cannot tell the output format" in capsys.readouterr().err
    assert main(["trace", "synth", "--out", str(tmp_path / "d.csv"), "--duration", "-1"]) == 2
    assert "duration_s must be a positive" in capsys.readouterr().err
    assert not (tmp_path / "d.csv").exists()


def hostile_trace(tmp_path):
    """200 good JSONL rows, then 50 with 2**62 output tokens, a 2**62 prompt, a 1e308 output
    and a line nested deeper than the JSON decoder's recursion limit."""
    rows = [
        {"arrival_s": i * 0.5, "prompt_tokens": 40 + i % 7, "output_tokens": 10 + i % 5}
        for i in range(200)
    ]
    rows += [{"arrival_s": 1.0, "prompt_tokens": 40, "output_tokens": 2**62}] * 50
    rows.append({"arrival_s": 2.0, "prompt_tokens": 2**62, "output_tokens": 3})
    rows.append({"arrival_s": 3.0, "prompt_tokens": 30, "output_tokens": 1e308})
    path = tmp_path / "hostile.jsonl"
    path.write_text("\n".join([*map(json.dumps, rows), "[" * 100_000]) + "\n")
    return path


@pytest.mark.parametrize("command", ["recommend", "replay"])
@pytest.mark.slow
def test_huge_lengths_and_deep_nesting_are_skipped_and_counted(tmp_path, capsys, command):
    args = [command, str(hostile_trace(tmp_path)), "--policy", "default", "--json", "-"]
    assert main(args if command == "replay" else args[:-1]) == 0
    printed = capsys.readouterr()
    assert "skipped 53 of 253 rows: malformed_json 1, length_over_limit 52" in printed.err
    report = json.loads(printed.out)
    if command == "recommend":
        assert report["window"]["count"] == 200
        assert report["switch_cost_s"] >= 0
    else:
        assert report["trace"]["replayed"] == 200
