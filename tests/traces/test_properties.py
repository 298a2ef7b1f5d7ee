"""Property tests: any mix of good and bad rows is split exactly, whatever the chunk size."""

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blocktune.traces.loaders import TraceError, load_trace

BAD_LENGTHS = ["", "NaN", "x", "2.5", "-3", "0", "inf", "-0.5"]
BAD_TIMES = ["", "soon", "inf"]

lengths = st.one_of(st.integers(1, 10**6).map(str), st.sampled_from(BAD_LENGTHS))
times = st.one_of(
    st.floats(0, 1e6, allow_nan=False).map(repr),
    st.integers(0, 10**6).map(str),
    st.sampled_from(BAD_TIMES),
)
rows = st.lists(st.tuples(times, lengths, lengths), min_size=1, max_size=40)


def number(cell):
    try:
        return float(cell)
    except ValueError:
        return math.nan


def expected_reason(time, prompt, output):
    """The documented order: missing values, then timestamps, then each length check."""
    if any(cell in ("", "NaN") for cell in (time, prompt, output)):
        return "missing_value"
    if not math.isfinite(number(time)):
        return "bad_timestamp"
    values = [number(prompt), number(output)]
    checks = [
        ("non_integer_length", lambda v: not (math.isfinite(v) and v == int(v))),
        ("negative_length", lambda v: v < 0),
        ("zero_length", lambda v: v == 0),
    ]
    for reason, failed in checks:
        if any(failed(v) for v in values):
            return reason
    return None


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(rows=rows, chunksize=st.integers(1, 7))
def test_rows_are_kept_or_counted_under_their_first_reason(tmp_path, rows, chunksize):
    path = tmp_path / "trace.csv"
    body = "".join(f"{t},{p},{o}\n" for t, p, o in rows)
    path.write_text("arrival_s,prompt_tokens,output_tokens\n" + body)
    reasons = [expected_reason(*row) for row in rows]
    good = [row for row, reason in zip(rows, reasons, strict=True) if reason is None]
    bad_lines: dict[str, list[int]] = {}
    for line, reason in enumerate(reasons, start=2):
        if reason is not None:
            bad_lines.setdefault(reason, []).append(line)

    if not good:
        with pytest.raises(TraceError, match="no usable rows"):
            load_trace(path, chunksize=chunksize)
        return
    loaded = load_trace(path, chunksize=chunksize)
    assert loaded.rows_read == len(rows)
    assert loaded.skipped == {r: len(lines) for r, lines in bad_lines.items()}
    assert loaded.first_bad_lines == {r: lines[:5] for r, lines in bad_lines.items()}
    times_kept = sorted(float(t) for t, _, _ in good)
    frame = loaded.frame
    assert frame.arrival_s.tolist() == pytest.approx([t - times_kept[0] for t in times_kept])
    assert sorted(frame.prompt_tokens) == sorted(int(float(p)) for _, p, _ in good)
    assert frame.output_tokens.sum() == sum(int(float(o)) for _, _, o in good)
    assert (frame.prompt_tokens >= 1).all() and (frame.output_tokens >= 1).all()

    first_bad = min((line for lines in bad_lines.values() for line in lines), default=None)
    if first_bad is None:
        assert len(load_trace(path, strict=True, chunksize=chunksize).frame) == len(rows)
    else:
        with pytest.raises(TraceError, match=f"line {first_bad}[,:]"):
            load_trace(path, strict=True, chunksize=chunksize)
