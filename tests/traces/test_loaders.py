"""Trace loaders on tiny inline files: every format, every bad-input case, default and strict."""

import json

import numpy as np
import pandas as pd
import pytest

from blocktune.traces.loaders import FORMATS, TraceError, load_trace
from blocktune.traces.schema import MAX_TOKENS, REASONS


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


# --- CSV-based formats: one good file layout each, then the same bad cells in every one ---

CSV_LAYOUTS = {
    # fmt: (file name, header, columns of time/prompt/output, good time of data row i, extras)
    "azure": (
        "azure.csv",
        ["TIMESTAMP", "ContextTokens", "GeneratedTokens"],
        ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
        lambda i: f"2023-11-16 18:15:{10 + i:02d}.5000000",
    ),
    "burstgpt": (
        "burst.csv",
        [
            "Timestamp",
            "Model",
            "Request tokens",
            "Response tokens",
            "Total tokens",
            "Log Type",
        ],
        ("Timestamp", "Request tokens", "Response tokens"),
        lambda i: f"{5 + 2 * i}",
    ),
    "lengths": (
        "lengths.csv",
        ["num_prefill_tokens", "num_decode_tokens", "num_total_tokens"],
        (None, "num_prefill_tokens", "num_decode_tokens"),
        None,
    ),
    "csv": (
        "mine.csv",
        ["arrival_s", "prompt_tokens", "output_tokens", "note"],
        ("arrival_s", "prompt_tokens", "output_tokens"),
        lambda i: f"{1.25 * i}",
    ),
}


def csv_rows(fmt, rows):
    """A file of `fmt` from rows of (time text, prompt text, output text)."""
    name, header, (time_col, prompt_col, output_col), _ = CSV_LAYOUTS[fmt]
    lines = [",".join(header)]
    for time, prompt, output in rows:
        cells = {"Model": "ChatGPT", "Log Type": "Conversation log", "note": "x"}
        cells.update({prompt_col: prompt, output_col: output})
        if time_col:
            cells[time_col] = time
        cells.setdefault("Total tokens", "0")
        cells.setdefault("num_total_tokens", "0")
        lines.append(",".join(cells[c] for c in header))
    return name, "\n".join(lines) + "\n"


def good_rows(fmt, count):
    clock = CSV_LAYOUTS[fmt][3] or (lambda i: "")
    return [(clock(i), str(10 + i), str(3 + i)) for i in range(count)]


BAD_CELLS = [
    # (field, text, reason)
    ("prompt", "", "missing_value"),
    ("output", "NaN", "missing_value"),
    ("prompt", "many", "non_integer_length"),
    ("output", "2.5", "non_integer_length"),
    ("output", "inf", "non_integer_length"),
    ("prompt", "-4", "negative_length"),
    ("output", "1e308", "length_over_limit"),
    ("prompt", str(10**26), "length_over_limit"),
    ("output", str(2**63 - 1), "length_over_limit"),
    ("prompt", str(MAX_TOKENS + 1), "length_over_limit"),
    ("prompt", "0", "zero_length"),
    ("time", "", "missing_value"),
    ("time", "yesterday", "bad_timestamp"),
]
CASES = [
    (fmt, field, text, reason)
    for fmt in CSV_LAYOUTS
    for field, text, reason in BAD_CELLS
    if not (fmt == "lengths" and field == "time")
] + [("azure", "output", "0", "zero_length"), ("burstgpt", "prompt", "0", "zero_length")]


def load_csv_case(tmp_path, fmt, rows, **kwargs):
    name, text = csv_rows(fmt, rows)
    extra = {"rate": 2.0} if fmt == "lengths" else {}
    return load_trace(write(tmp_path, name, text), fmt, **extra, **kwargs)


@pytest.mark.parametrize(("fmt", "field", "text", "reason"), CASES)
def test_a_bad_cell_is_skipped_and_counted_or_stops_strict_mode(tmp_path, fmt, field, text, reason):
    rows = good_rows(fmt, 4)
    time, prompt, output = rows[1]
    rows[1] = {
        "time": (text, prompt, output),
        "prompt": (time, text, output),
        "output": (time, prompt, text),
    }[field]
    loaded = load_csv_case(tmp_path, fmt, rows)
    assert loaded.format == fmt
    assert loaded.rows_read == 4
    assert loaded.skipped == {reason: 1}
    assert loaded.first_bad_lines == {reason: [3]}  # header is line 1, the bad row line 3
    assert loaded.frame.prompt_tokens.tolist() == [10, 12, 13]
    assert loaded.frame.output_tokens.tolist() == [3, 5, 6]

    column = CSV_LAYOUTS[fmt][2][("time", "prompt", "output").index(field)]
    with pytest.raises(TraceError) as error:
        load_csv_case(tmp_path, fmt, rows, strict=True)
    message = str(error.value)
    assert CSV_LAYOUTS[fmt][0] in message
    assert "line 3," in message
    assert repr(column) in message
    assert REASONS[reason] in message


def test_burstgpt_failed_requests_are_dropped_and_counted_even_in_strict_mode(tmp_path):
    rows = good_rows("burstgpt", 5)
    for index in (1, 3):
        rows[index] = (rows[index][0], rows[index][1], "0")
    for strict in (False, True):
        loaded = load_csv_case(tmp_path, "burstgpt", rows, strict=strict)
        assert loaded.skipped == {"failed_request": 2}
        assert loaded.first_bad_lines == {"failed_request": [3, 5]}
        assert loaded.frame.prompt_tokens.tolist() == [10, 12, 14]
    rows[4] = (rows[4][0], "-1", rows[4][2])
    with pytest.raises(TraceError, match=r"line 6, column 'Request tokens': negative length"):
        load_csv_case(tmp_path, "burstgpt", rows, strict=True)


def test_strict_mode_names_the_first_bad_row_even_in_a_later_chunk(tmp_path):
    rows = good_rows("csv", 7)
    rows[5] = (rows[5][0], "-1", rows[5][2])
    rows[6] = (rows[6][0], "", rows[6][2])
    with pytest.raises(TraceError, match=r"line 7, column 'prompt_tokens': negative length"):
        load_csv_case(tmp_path, "csv", rows, strict=True, chunksize=2)


def test_chunked_reading_keeps_line_numbers_and_results(tmp_path):
    rows = good_rows("azure", 12)
    for index in (2, 5, 6, 9, 10, 11):
        rows[index] = (rows[index][0], "0", rows[index][2])
    whole = load_csv_case(tmp_path, "azure", rows)
    for chunksize in (1, 2, 5):
        chunked = load_csv_case(tmp_path, "azure", rows, chunksize=chunksize)
        pd.testing.assert_frame_equal(chunked.frame, whole.frame)
        assert chunked.skipped == whole.skipped == {"zero_length": 6}
        assert chunked.first_bad_lines == {"zero_length": [4, 7, 8, 11, 12]}


def test_a_blank_line_counts_as_missing_values_at_its_line(tmp_path):
    text = "arrival_s,prompt_tokens,output_tokens\n0,5,5\n\n2,6,6\n"
    loaded = load_trace(write(tmp_path, "t.csv", text))
    assert loaded.skipped == {"missing_value": 1}
    assert loaded.first_bad_lines == {"missing_value": [3]}
    assert loaded.frame.prompt_tokens.tolist() == [5, 6]


def test_first_bad_lines_keep_the_first_five_and_the_count_all(tmp_path):
    rows = [(str(i), "x" if i % 2 else "5", "5") for i in range(20)]
    loaded = load_csv_case(tmp_path, "csv", rows, chunksize=3)
    assert loaded.skipped == {"non_integer_length": 10}
    assert loaded.first_bad_lines == {"non_integer_length": [3, 5, 7, 9, 11]}
    assert len(loaded.frame) == 10


# --- Azure timestamps ---


def test_azure_timestamps_keep_all_seven_fractional_digits(tmp_path):
    stamps = ["2023-11-16 18:15:46.6805900", "2023-11-16 18:15:46.6805901", "2023-11-16 18:16:02.0"]
    text = "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"{s},{100 + i},{10 + i}\n" for i, s in enumerate(stamps)
    )
    loaded = load_trace(write(tmp_path, "az.csv", text))
    assert loaded.format == "azure"
    origin = np.datetime64(stamps[0].replace(" ", "T"), "ns")
    expected = [
        (np.datetime64(s.replace(" ", "T"), "ns") - origin) / np.timedelta64(1, "s") for s in stamps
    ]
    assert expected[1] == pytest.approx(1e-7)
    np.testing.assert_allclose(loaded.frame.arrival_s, expected, rtol=0, atol=1e-12)
    assert loaded.frame.arrival_s.iloc[1] > 0


def test_azure_timestamps_with_utc_offsets_are_compared_in_utc(tmp_path):
    text = (
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16T18:00:00+01:00,5,5\n"
        "2023-11-16T17:30:00Z,6,6\n"
    )
    loaded = load_trace(write(tmp_path, "az.csv", text), "azure")
    assert loaded.frame.arrival_s.tolist() == [0.0, 1800.0]


# --- unsorted, rates, mapping ---


def test_unsorted_timestamps_are_sorted_with_a_warning(tmp_path):
    text = "arrival_s,prompt_tokens,output_tokens\n10,1,1\n4,2,2\n7,3,3\n6,4,4\n"
    loaded = load_trace(write(tmp_path, "u.csv", text))
    assert loaded.frame.arrival_s.tolist() == [0.0, 2.0, 3.0, 6.0]
    assert loaded.frame.prompt_tokens.tolist() == [2, 4, 3, 1]
    assert len(loaded.warnings) == 1
    assert "not sorted" in loaded.warnings[0] and "line 3" in loaded.warnings[0]
    assert "2 rows" in loaded.warnings[0]


def test_sorted_timestamps_give_no_warning(tmp_path):
    loaded = load_csv_case(tmp_path, "burstgpt", good_rows("burstgpt", 3))
    assert loaded.warnings == []
    assert loaded.frame.arrival_s.tolist() == [0.0, 2.0, 4.0]


def test_lengths_need_a_rate_and_get_seeded_poisson_arrivals(tmp_path):
    name, text = csv_rows("lengths", good_rows("lengths", 2000))
    path = write(tmp_path, name, text)
    with pytest.raises(TraceError, match="no arrival times; give a rate"):
        load_trace(path)
    first = load_trace(path, rate=10.0, seed=1)
    again = load_trace(path, "lengths", rate=10.0, seed=1)
    other = load_trace(path, rate=10.0, seed=2)
    pd.testing.assert_frame_equal(first.frame, again.frame)
    assert not first.frame.arrival_s.equals(other.frame.arrival_s)
    arrivals = first.frame.arrival_s.to_numpy()
    assert arrivals[0] == 0 and (np.diff(arrivals) >= 0).all()
    assert np.diff(arrivals).mean() == pytest.approx(0.1, rel=0.1)
    # Rows keep their file order: arrivals are assigned in order.
    assert first.frame.prompt_tokens.tolist() == list(range(10, 2010))


def test_a_rate_replaces_the_timestamps_of_a_timed_trace(tmp_path):
    loaded = load_csv_case(tmp_path, "azure", good_rows("azure", 400), rate=4.0)
    assert loaded.format == "azure"
    assert np.diff(loaded.frame.arrival_s).mean() == pytest.approx(0.25, rel=0.2)


def test_column_mapping_for_a_team_log_in_jsonl(tmp_path):
    records = [{"t": 1_000 + 250 * i, "in": 7 + i, "out": 2, "user": "a"} for i in range(4)]
    path = write(tmp_path, "log.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    loaded = load_trace(path, time_col="t", time_unit="ms", prompt_col="in", output_col="out")
    assert loaded.format == "jsonl"
    assert loaded.frame.arrival_s.tolist() == [0.0, 0.25, 0.5, 0.75]
    assert loaded.frame.prompt_tokens.tolist() == [7, 8, 9, 10]


def test_column_mapping_with_datetime_text_in_csv(tmp_path):
    text = "when,p,o\n2024-01-01 00:00:00,3,4\n2024-01-01 00:01:30.25,5,6\n"
    loaded = load_trace(
        write(tmp_path, "log.csv", text),
        "csv",
        time_col="when",
        time_unit="datetime",
        prompt_col="p",
        output_col="o",
    )
    assert loaded.frame.arrival_s.tolist() == [0.0, 90.25]


def test_a_missing_column_names_file_column_and_what_was_found(tmp_path):
    path = write(tmp_path, "log.csv", "arrival_s,prompt,output_tokens\n0,1,1\n")
    with pytest.raises(TraceError) as error:
        load_trace(path)
    message = str(error.value)
    assert "log.csv, line 1" in message and "'prompt_tokens'" in message
    assert "'prompt'" in message
    with pytest.raises(TraceError, match="missing column 'GeneratedTokens'"):
        load_trace(write(tmp_path, "az.csv", "TIMESTAMP,ContextTokens\nx,1\n"), "azure")


# --- JSON lines: Mooncake and generic ---


def mooncake_line(i, **changes):
    record = {"timestamp": 1000 * i, "input_length": 600 + i, "output_length": 20 + i}
    record["hash_ids"] = [46, 47 + i]
    record.update(changes)
    return json.dumps(record)


def test_mooncake_loads_times_in_ms_and_splits_prefix_hashes(tmp_path):
    lines = [mooncake_line(0), mooncake_line(1), mooncake_line(2, hash_ids=[])]
    path = write(tmp_path, "mooncake_trace.jsonl", "\n".join(lines) + "\n")
    loaded = load_trace(path)
    frame = loaded.frame
    assert loaded.format == "mooncake"
    assert frame.arrival_s.tolist() == [0.0, 1.0, 2.0]
    assert frame.prompt_tokens.tolist() == [600, 601, 602]
    # One 512-token Mooncake block = two 256-token canonical blocks.
    assert frame.prefix_hashes.tolist() == [[92, 93, 94, 95], [92, 93, 96, 97], []]
    assert frame.prefix_group.tolist() == ["46", "46", None]


JSON_BAD = [
    ('{"timestamp": 1000, "input_length": 600', None, "malformed_json"),
    ("[1, 2, 3]", None, "malformed_json"),
    (mooncake_line(1, input_length=None), "input_length", "missing_value"),
    (
        json.dumps({"timestamp": 1000, "input_length": 5, "hash_ids": [1]}),
        "output_length",
        "missing_value",
    ),
    (mooncake_line(1, timestamp="soon"), "timestamp", "bad_timestamp"),
    (mooncake_line(1, output_length="lots"), "output_length", "non_integer_length"),
    (mooncake_line(1, output_length=True), "output_length", "non_integer_length"),
    (mooncake_line(1, input_length=[3]), "input_length", "non_integer_length"),
    (mooncake_line(1, input_length=-2), "input_length", "negative_length"),
    (mooncake_line(1, input_length=10**26), "input_length", "length_over_limit"),
    (mooncake_line(1, output_length=2**62), "output_length", "length_over_limit"),
    ("[" * 100_000, None, "malformed_json"),  # deeper than the JSON decoder's recursion
    ('{"a": ' * 50_000, None, "malformed_json"),
    (mooncake_line(1, output_length=0), "output_length", "zero_length"),
    (mooncake_line(1, hash_ids=[1, "two"]), "hash_ids", "bad_prefix_hashes"),
    (mooncake_line(1, hash_ids={"a": 1}), "hash_ids", "bad_prefix_hashes"),
]


@pytest.mark.parametrize(("bad_line", "column", "reason"), JSON_BAD)
def test_a_bad_mooncake_line_is_skipped_or_stops_strict_mode(tmp_path, bad_line, column, reason):
    lines = [mooncake_line(0), bad_line, mooncake_line(2), mooncake_line(3)]
    path = write(tmp_path, "t.jsonl", "\n".join(lines) + "\n")
    loaded = load_trace(path, "mooncake")
    assert loaded.skipped == {reason: 1}
    assert loaded.first_bad_lines == {reason: [2]}
    assert loaded.frame.prompt_tokens.tolist() == [600, 602, 603]
    with pytest.raises(TraceError) as error:
        load_trace(path, "mooncake", strict=True)
    message = str(error.value)
    assert "t.jsonl, line 2" in message and REASONS[reason] in message
    if column:
        assert repr(column) in message


def test_generic_jsonl_reads_canonical_prefix_columns(tmp_path):
    records = [
        {
            "arrival_s": 0.5,
            "prompt_tokens": 300,
            "output_tokens": 9,
            "prefix_group": "doc-1",
            "prefix_hashes": [77],
        },
        {
            "arrival_s": 1.5,
            "prompt_tokens": 30,
            "output_tokens": 9,
            "prefix_group": None,
            "prefix_hashes": [],
        },
    ]
    path = write(tmp_path, "day.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    loaded = load_trace(path)
    assert loaded.format == "jsonl"
    assert loaded.frame.prefix_group.tolist() == ["doc-1", None]
    assert loaded.frame.prefix_hashes.tolist() == [[77], []]
    assert loaded.frame.arrival_s.tolist() == [0.0, 1.0]


# --- Parquet ---


def test_parquet_rows_are_checked_like_any_other(tmp_path):
    frame = pd.DataFrame(
        {
            "arrival_s": [0.0, 1.0, 2.0, np.nan, 4.0, 5.0],
            "prompt_tokens": [5.0, 0.0, 7.0, 8.0, 2.5, 9.0],
            "output_tokens": [1.0, 1.0, np.nan, 1.0, 1.0, -1.0],
        }
    )
    path = tmp_path / "t.parquet"
    frame.to_parquet(path)
    loaded = load_trace(path, chunksize=4)
    assert loaded.format == "parquet"
    assert loaded.frame.prompt_tokens.tolist() == [5]
    assert loaded.skipped == {
        "missing_value": 2,
        "zero_length": 1,
        "non_integer_length": 1,
        "negative_length": 1,
    }
    assert loaded.first_bad_lines["missing_value"] == [3, 4]  # 1-based row numbers
    with pytest.raises(TraceError, match=r"t.parquet, line 2, column 'prompt_tokens': zero"):
        load_trace(path, strict=True)


# --- auto detection ---


DETECTION = [
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,5,6\n", "azure"),
    (
        "b.csv",
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "1.0,ChatGPT,5,6,11,Conversation log\n",
        "burstgpt",
    ),
    ("c.csv", "num_prefill_tokens,num_decode_tokens\n5,6\n", "lengths"),
    ("d.csv", "arrival_s,prompt_tokens,output_tokens\n0,5,6\n", "csv"),
    ("e.txt", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,5,6\n", "azure"),
    ("f.jsonl", mooncake_line(0) + "\n", "mooncake"),
    ("g", mooncake_line(0) + "\n", "mooncake"),
    ("h.ndjson", '{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 6}\n', "jsonl"),
    ("i", "arrival_s,prompt_tokens,output_tokens\n0,5,6\n", "csv"),
]


@pytest.mark.parametrize(("name", "text", "expected"), DETECTION)
def test_auto_detects_the_format_from_header_and_extension(tmp_path, name, text, expected):
    loaded = load_trace(write(tmp_path, name, text), rate=1.0 if expected == "lengths" else None)
    assert loaded.format == expected
    assert loaded.frame.prompt_tokens.tolist() == [600 if expected == "mooncake" else 5]


def test_auto_detects_a_named_layout_stored_as_parquet(tmp_path):
    frame = pd.DataFrame(
        {
            "TIMESTAMP": ["2023-11-16 18:15:46.5", "2023-11-16 18:15:47.0"],
            "ContextTokens": [5, 6],
            "GeneratedTokens": [7, 8],
        }
    )
    frame.to_parquet(tmp_path / "az.parquet")
    (tmp_path / "noext").write_bytes((tmp_path / "az.parquet").read_bytes())
    for name in ("az.parquet", "noext"):
        loaded = load_trace(tmp_path / name)
        assert loaded.format == "azure"
        assert loaded.frame.arrival_s.tolist() == [0.0, 0.5]


def test_mapping_flags_with_auto_select_the_generic_layout(tmp_path):
    text = "TIMESTAMP,ContextTokens,GeneratedTokens,t\n2023-11-16 18:15:46.1,5,6,3\n"
    loaded = load_trace(
        write(tmp_path, "a.csv", text),
        time_col="t",
        prompt_col="ContextTokens",
        output_col="GeneratedTokens",
    )
    assert loaded.format == "csv"


# --- files and arguments that cannot be used ---


@pytest.mark.parametrize("text", ["", "  \n\n"])
def test_an_empty_file_is_a_clear_error(tmp_path, text):
    with pytest.raises(TraceError, match=r"empty\.csv: the file is empty"):
        load_trace(write(tmp_path, "empty.csv", text))


def test_a_header_without_rows_is_a_clear_error(tmp_path):
    with pytest.raises(TraceError, match="header but no rows"):
        load_trace(write(tmp_path, "h.csv", "arrival_s,prompt_tokens,output_tokens\n"))


def test_a_file_without_a_usable_row_reports_what_was_skipped(tmp_path):
    text = "arrival_s,prompt_tokens,output_tokens\n0,0,5\n1,-1,5\n"
    with pytest.raises(TraceError) as error:
        load_trace(write(tmp_path, "bad.csv", text))
    message = str(error.value)
    assert "no usable rows out of 2" in message
    assert "zero_length 1 (lines 2)" in message and "negative_length 1 (lines 3)" in message


def test_unreadable_paths_are_clear_errors(tmp_path):
    with pytest.raises(TraceError, match="is a directory"):
        load_trace(tmp_path)
    with pytest.raises(TraceError, match=r"nope\.csv: cannot read the trace"):
        load_trace(tmp_path / "nope.csv")
    (tmp_path / "x.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(TraceError, match=r"x\.parquet: not a readable Parquet file"):
        load_trace(tmp_path / "x.parquet")
    (tmp_path / "x.csv").write_bytes(b"arrival_s,prompt_tokens,output_tokens\n0,1,\xff\xfe\n")
    with pytest.raises(TraceError, match=r"x\.csv: not a readable CSV file"):
        load_trace(tmp_path / "x.csv")
    with pytest.raises(TraceError, match="no line holds a JSON object"):
        load_trace(write(tmp_path, "j.jsonl", "not json\n[1]\n"))


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"fmt": "excel"}, "unknown format 'excel'"),
        ({"time_unit": "h"}, "unknown time unit 'h'"),
        ({"rate": 0.0}, "rate must be a positive"),
        ({"rate": float("nan")}, "rate must be a positive"),
        ({"rate": 1.0, "time_col": "arrival_s"}, "either a time column or a rate"),
        ({"fmt": "azure", "prompt_col": "p"}, "column mapping .* not to 'azure'"),
        ({"fmt": "burstgpt", "time_unit": "ms"}, "column mapping .* not to 'burstgpt'"),
        ({"chunksize": 0}, "chunksize must be at least 1"),
    ],
)
def test_bad_arguments_are_trace_errors_naming_the_value(tmp_path, kwargs, pattern):
    path = write(tmp_path, "ok.csv", "arrival_s,prompt_tokens,output_tokens\n0,5,6\n")
    with pytest.raises(TraceError, match=pattern):
        load_trace(path, **kwargs)


def test_trace_error_is_a_value_error_and_formats_start_with_auto():
    assert issubclass(TraceError, ValueError)
    assert FORMATS[0] == "auto"
    assert set(FORMATS) == {
        "auto",
        "azure",
        "burstgpt",
        "mooncake",
        "lengths",
        "csv",
        "jsonl",
        "parquet",
    }
