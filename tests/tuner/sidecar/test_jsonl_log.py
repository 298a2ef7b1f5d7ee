"""The JSONL request-log follower: appends, partial lines, bad lines, rotation, truncation."""

import json
import os
import time
from pathlib import Path

import httpx
import pytest

from blocktune.tuner.config.policy import JsonlLogSettings, Sources, load_policy
from blocktune.tuner.serving.sidecar_app import create_sidecar_app
from blocktune.tuner.sidecar.assembly import build_sidecar
from blocktune.tuner.sidecar.jsonl_log import MAX_LINE_BYTES, JsonlLogFollower
from blocktune.tuner.sidecar.sources import SourceRunner

POLICY = load_policy(Path(__file__).resolve().parents[3] / "policies" / "default.yaml")


def line(prompt, output, **extra) -> str:
    return json.dumps({"usage": {"prompt_tokens": prompt, "completion_tokens": output}, **extra})


def append(path: Path, *lines: str, newline: bool = True) -> None:
    with path.open("a", encoding="utf-8") as out:
        out.write("\n".join(lines) + ("\n" if newline else ""))


class Received:
    """A sink that keeps every (prompt, output, timestamp, group) handed to it."""

    def __init__(self) -> None:
        self.rows: list[tuple] = []

    def __call__(self, batch) -> None:
        groups = batch.prefix_groups or [None] * len(batch)
        for row in zip(
            batch.prompt_tokens.tolist(),
            batch.output_tokens.tolist(),
            batch.timestamps.tolist(),
            groups,
            strict=True,
        ):
            self.rows.append(row)

    def lengths(self) -> list[tuple[int, int]]:
        return [(p, o) for p, o, _, _ in self.rows]


@pytest.fixture
def settings():
    return JsonlLogSettings(
        path="requests.jsonl",
        interval="1s",
        prompt_field="usage.prompt_tokens",
        output_field="usage.completion_tokens",
        timestamp_field="finished_at",
        prefix_field="tenant",
        start_at="beginning",
    )


def test_follows_appends_and_skips_bad_lines(tmp_path, settings):
    log = tmp_path / "requests.jsonl"
    sink = Received()
    follower = JsonlLogFollower(settings, sink, base=tmp_path, clock=lambda: 500.0)
    with pytest.raises(FileNotFoundError, match="requests.jsonl"):
        follower.poll()
    append(log, line(10, 3, finished_at=123.5, tenant=7), line(20, 0))
    assert follower.poll() == 2
    assert sink.rows == [(10, 3, 123.5, "7"), (20, 0, 500.0, None)]

    append(
        log,
        "not json",
        "[1, 2]",
        json.dumps({"usage": {"prompt_tokens": 5}}),  # no output field
        line(0, 4),  # a prompt needs a token
        line(7, 2.5),
        line(3, 1, finished_at="yesterday"),
        "",
        line(30, 9),
    )
    append(log, line(40, 1)[:-5], newline=False)  # half written: waits for its newline
    assert follower.poll() == 1
    assert follower.bad_lines == 6 and follower.status.errors == 6
    assert "field 'finished_at': Input should be a valid number" in follower.status.last_error
    append(log, line(40, 1)[-5:])
    assert follower.poll() == 1
    assert sink.lengths()[-2:] == [(30, 9), (40, 1)]
    follower.close()


def test_survives_rotation_and_truncation(tmp_path, settings):
    log = tmp_path / "requests.jsonl"
    append(log, line(1, 1), line(2, 2))
    sink = Received()
    follower = JsonlLogFollower(settings, sink, base=tmp_path)
    assert follower.poll() == 2

    # logrotate's rename: the writer finishes the old file, then starts a new one.
    append(log, line(3, 3))
    os.rename(log, tmp_path / "requests.jsonl.1")
    append(tmp_path / "requests.jsonl.1", line(4, 4))
    append(log, line(5, 5))
    assert follower.poll() == 3 and follower.rotations == 1
    append(log, line(6, 6))
    assert follower.poll() == 1

    # copytruncate: the same file starts again from empty.
    with log.open("w", encoding="utf-8") as out:
        out.write(line(7, 7) + "\n")
    assert follower.poll() == 1 and follower.truncations == 1
    assert sink.lengths() == [(n, n) for n in range(1, 8)]

    # Rotated away with no new file yet: the rest of the old one is read, then polls fail.
    append(log, line(8, 8))
    os.rename(log, tmp_path / "requests.jsonl.2")
    assert follower.poll() == 1
    SourceRunner.poll(follower)
    assert follower.status.last_ok is False and "no such request log" in follower.status.last_error
    append(log, line(9, 9))
    SourceRunner.poll(follower)
    assert follower.status.last_ok is True and sink.lengths()[-2:] == [(8, 8), (9, 9)]
    follower.close()


def test_one_hostile_line_costs_only_itself(tmp_path, settings):
    log = tmp_path / "requests.jsonl"
    good = [line(10 + i, 5) for i in range(100)]
    hostile = ['{"usage": ' * 100_000, line(3, 4, finished_at=float("nan")), '"\\ud800"']
    append(log, *good[:50], *hostile, *good[50:])
    sink = Received()
    follower = JsonlLogFollower(settings, sink, base=tmp_path)
    assert follower.poll() == 100 and follower.bad_lines == 3
    assert sink.lengths() == [(10 + i, 5) for i in range(100)]
    assert follower.status.errors == 3
    follower.close()


def test_a_truncation_rewritten_past_the_old_offset_is_read_from_its_start(tmp_path, settings):
    log = tmp_path / "requests.jsonl"
    append(log, line(1, 1, finished_at=1.0), line(2, 2, finished_at=2.0))
    sink = Received()
    follower = JsonlLogFollower(settings, sink, base=tmp_path)
    assert follower.poll() == 2
    # Between two polls: truncated, then more written than had been read before.
    rewritten = [line(n, n, finished_at=float(n)) for n in range(3, 9)]
    log.write_text("\n".join(rewritten) + "\n")
    assert follower.poll() == 6 and follower.truncations == 1
    assert sink.lengths() == [(n, n) for n in range(1, 9)]
    append(log, line(9, 9))
    assert follower.poll() == 1 and follower.truncations == 1
    follower.close()


def test_a_rewrite_in_place_that_keeps_the_first_lines_is_read_from_its_start(tmp_path, settings):
    log = tmp_path / "requests.jsonl"
    first = [line(n, 1, finished_at=float(n)) for n in range(1, 21)]  # well over 256 bytes
    append(log, *first, *[line(7, 7, finished_at=100.0)] * 480)
    sink = Received()
    follower = JsonlLogFollower(settings, sink, base=tmp_path)
    assert follower.poll() == 500
    # Between two polls, written over in place (same inode): the same first 20 lines, then
    # 520 other ones, so the file is longer than what was read.
    with log.open("r+", encoding="utf-8") as out:
        out.write("\n".join([*first, *[line(9, 9, finished_at=200.0)] * 520]) + "\n")
    assert follower.poll() == 540 and follower.truncations == 1
    assert sink.lengths()[500:] == [(n, 1) for n in range(1, 21)] + [(9, 9)] * 520
    append(log, line(5, 5))
    assert follower.poll() == 1 and follower.truncations == 1
    follower.close()


def test_starts_at_the_end_of_an_existing_log_by_default(tmp_path, settings):
    log = tmp_path / "requests.jsonl"
    append(log, line(1, 1), line(2, 2))
    sink = Received()
    follower = JsonlLogFollower(
        settings.model_copy(update={"start_at": "end"}), sink, base=tmp_path
    )
    assert follower.poll() == 0
    append(log, line(3, 3))
    assert follower.poll() == 1 and sink.lengths() == [(3, 3)]
    follower.close()


def test_sidecar_reads_the_log_on_its_schedule(tmp_path, settings, live_server):
    log = tmp_path / "requests.jsonl"
    append(log, *(line(12 + n % 9, 6 + n % 13, tenant="shop") for n in range(150)), "oops")
    fast = settings.model_copy(update={"interval": settings.interval / 20})
    policy = POLICY.model_copy(update={"sources": Sources(push=False, jsonl_log=fast)})
    sidecar = build_sidecar(policy, base_dir=tmp_path)
    with live_server(create_sidecar_app(sidecar)) as url:
        deadline = time.monotonic() + 15  # the runner polls every 50 ms on its own thread
        while len(sidecar.window) < 150 and time.monotonic() < deadline:
            time.sleep(0.02)
        window = httpx.get(f"{url}/v1/window").json()
        ready = httpx.get(f"{url}/readyz").json()
        errors = httpx.get(f"{url}/metrics").text
    assert window["count"] == 150
    assert ready["ready"] is True and ready["sources"]["jsonl_log"]["samples"] == 150
    assert 'blocktune_source_errors_total{source="jsonl_log"} 1.0' in errors


def test_a_line_over_the_bound_is_skipped_and_counted_without_being_held(tmp_path, settings):
    log = tmp_path / "requests.jsonl"
    log.write_bytes(b"x" * (5 * MAX_LINE_BYTES))  # several MB and no newline yet
    sink = Received()
    follower = JsonlLogFollower(settings, sink, base=tmp_path, max_bytes=MAX_LINE_BYTES // 2)
    held = []
    for _ in range(12):
        assert follower.poll() == 0
        held.append(len(follower._partial))
    append(log, "the over-long line's end", line(7, 3))
    assert follower.poll() == 1 and sink.lengths() == [(7, 3)]
    assert max(held) <= MAX_LINE_BYTES
    status = follower.status.to_dict()
    assert status["oversized_lines"] == 1 and status["errors"] == 1
    assert f"over {MAX_LINE_BYTES} bytes" in status["last_error"]
    follower.close()


def test_a_whole_over_long_line_in_one_read_is_skipped(tmp_path, settings):
    log = tmp_path / "requests.jsonl"
    append(log, line(5, 2), "y" * (3 * MAX_LINE_BYTES), line(7, 3), "z" * MAX_LINE_BYTES)
    sink = Received()
    follower = JsonlLogFollower(settings, sink, base=tmp_path)
    assert follower.poll() == 2 and sink.lengths() == [(5, 2), (7, 3)]
    assert follower.status.to_dict()["oversized_lines"] == 1  # a line of the bound is read
    assert follower.bad_lines == 1  # and is no JSON
    follower.close()
