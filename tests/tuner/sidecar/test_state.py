"""The sidecar's state file against hostile and unusable files: set aside or one clear error."""

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from blocktune.tuner.cli import main
from blocktune.tuner.config.policy import WindowSettings, load_policy
from blocktune.tuner.sidecar import state as state_module
from blocktune.tuner.sidecar.assembly import build_sidecar
from blocktune.tuner.sidecar.sidecar import Sidecar
from blocktune.tuner.sidecar.sources import Observations
from blocktune.tuner.sidecar.state import StateFile, StateFileError, StateTooLarge

DEFAULT = Path(__file__).resolve().parents[3] / "policies" / "default.yaml"
POLICY = load_policy(DEFAULT)
SMALL = POLICY.model_copy(update={"window": WindowSettings(capacity=100, min_samples=10)})


def observe(sidecar: Sidecar, count: int) -> None:
    rng = np.random.default_rng(count)
    sidecar.observe(
        Observations(
            rng.integers(15, 26, count),
            rng.integers(8, 25, count),
            1_700_000_000.0 + 0.2 * np.arange(count),
        )
    )


def saved_state(path: Path, count: int = 50) -> dict:
    """Save a sidecar's state of `count` requests at `path`; its JSON."""
    sidecar = build_sidecar(POLICY, state_file=path)
    observe(sidecar, count)
    sidecar.save_state()
    return json.loads(path.read_text())


def starts_fresh(path: Path, text: str, policy=POLICY) -> Sidecar:
    """Write `text` as the state file and start a sidecar: the file must be set aside."""
    path.write_text(text)
    sidecar = build_sidecar(policy, state_file=path)
    assert len(sidecar.window) == 0 and sidecar.current_block_size == 16
    assert not path.exists() and sidecar.state_file.set_aside_as.read_text() == text
    return sidecar


def test_a_window_integer_too_large_for_int64_is_set_aside(tmp_path):
    path = tmp_path / "state.json"
    saved = saved_state(path)
    saved["window"]["prompt_tokens"][0] = 10**30
    starts_fresh(path, json.dumps(saved))


def test_deeply_nested_json_is_set_aside(tmp_path):
    starts_fresh(tmp_path / "state.json", "[" * 100_000)


@pytest.mark.parametrize(
    ("change", "value"),
    [
        ("current_block_size", 2**40),
        ("current_block_size", 256),  # powers of two, but not among the candidates
        ("current_block_size", 65536),
        ("recommended_block_size", 4),
        ("deployment", "another-deployment"),
        ("saved_at", float("nan")),
        ("last_switch_at", float("inf")),
    ],
)
def test_a_state_that_does_not_fit_the_policy_is_set_aside(tmp_path, change, value):
    path = tmp_path / "state.json"
    saved = saved_state(path)
    starts_fresh(path, json.dumps({**saved, change: value}))


def test_nan_timestamps_in_the_window_are_set_aside(tmp_path):
    path = tmp_path / "state.json"
    saved = saved_state(path)
    saved["window"]["timestamps"][3] = float("nan")
    starts_fresh(path, json.dumps(saved))


@pytest.mark.parametrize("rows", [200, 60_000])  # over the capacity; over the bytes it allows
def test_a_window_larger_than_the_policy_holds_is_set_aside(tmp_path, rows, caplog):
    path = tmp_path / "state.json"
    saved = saved_state(path, count=1)
    saved["window"] = {k: v * rows for k, v in saved["window"].items() if k != "observed_total"}
    with caplog.at_level("INFO", logger="blocktune.sidecar"):
        starts_fresh(path, json.dumps(saved), policy=SMALL)
    problem = next(json.loads(r.message)["problem"] for r in caplog.records)
    assert ("more than its capacity 100" if rows == 200 else "over 1061376 bytes") in problem


@pytest.mark.parametrize("where", ["a folder", "a FIFO", "under a file"])
def test_an_unreadable_state_path_is_one_clear_error(tmp_path, capsys, where):
    """Not a regular file: one line and exit 2, at once (a FIFO opened to read would wait for
    a writer forever)."""
    if where == "a folder":
        path, expected = tmp_path / "state.json", "Is a directory"
        path.mkdir()
    elif where == "a FIFO":
        path, expected = tmp_path / "state.json", "not a regular file (a FIFO, socket or device)"
        os.mkfifo(path)
    else:
        (tmp_path / "file").write_text("")
        path, expected = tmp_path / "file" / "state.json", "Not a directory"
    message = f"{path}: cannot read the state file: {expected}"
    with pytest.raises(StateFileError, match=re.escape(message)):
        build_sidecar(POLICY, state_file=path)
    assert main(["serve", "--policy", str(DEFAULT), "--state-file", str(path)]) == 2
    error = capsys.readouterr().err
    assert error == f"blocktune serve: {path}: cannot read the state file: {expected}\n"


def test_a_corrupt_file_that_cannot_be_set_aside_is_one_clear_error(tmp_path, monkeypatch):
    path = tmp_path / "state.json"
    path.write_text("{not json")

    def read_only_folder(source, target):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(state_module.os, "replace", read_only_folder)
    with pytest.raises(StateFileError) as caught:
        build_sidecar(POLICY, state_file=path)
    message = str(caught.value)
    assert message.startswith(f"{path}: the state file is unusable (not valid JSON: ")
    assert "cannot be set aside (Permission denied)" in message
    assert path.read_text() == "{not json"


def test_temporaries_of_an_interrupted_save_are_removed_at_start(tmp_path):
    path = tmp_path / "state.json"
    saved_state(path)
    stale = [tmp_path / f".state.json.{name}.tmp" for name in ("k9x2_a", "q0")]
    for temporary in stale:
        temporary.write_bytes(b'{"version": 1, "saved_at"')
    (tmp_path / ".other.json.q1.tmp").write_text("")  # another file's: kept
    assert len(build_sidecar(POLICY, state_file=path).window) == 50
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.json.q1.tmp", "state.json"]


def test_the_lifetime_count_survives_a_restart(tmp_path):
    path = tmp_path / "state.json"
    first = build_sidecar(POLICY, state_file=path)
    observe(first, 1500)
    observe(first, 300)
    first.save_state()
    second = build_sidecar(POLICY, state_file=path)
    stats = second.window_stats()
    assert stats["count"] == 1000 and stats["observed_total"] == 1800
    observe(second, 7)
    assert second.window_stats()["observed_total"] == 1807


def test_failed_saves_are_counted_and_the_sidecar_keeps_deciding(tmp_path):
    path = tmp_path / "folder" / "state.json"
    sidecar = build_sidecar(POLICY, state_file=path)
    (tmp_path / "folder").write_text("a file where the state's folder should be")
    observe(sidecar, 300)
    assert sidecar.decide() is not None and sidecar.decide() is not None
    assert sidecar.stats().state_save_failures == 2
    os.remove(tmp_path / "folder")
    sidecar.save_state()
    assert json.loads(path.read_text())["window"]["observed_total"] == 300
    assert sidecar.stats().state_save_failures == 2


def test_a_state_too_large_to_load_back_is_not_saved_and_the_last_good_file_stays(tmp_path, caplog):
    path = tmp_path / "state.json"
    sidecar = build_sidecar(POLICY, state_file=path)
    observe(sidecar, 400)
    sidecar.save_state()
    good = path.read_bytes()
    huge = sidecar._saved_state().model_copy(update={"recommendation": {"x": "y" * 2_000_000}})
    with pytest.raises(StateTooLarge, match="over the 1176576 a state file of a 1000-row"):
        StateFile(path).save(huge, POLICY)
    sidecar._saved_state = lambda: huge  # a state that somehow grew past the limit
    with caplog.at_level("INFO", logger="blocktune.sidecar"):
        sidecar.save_state()
    assert sidecar.stats().state_save_failures == 1
    assert "state_save_failed" in caplog.text and "not saved" in caplog.text
    assert path.read_bytes() == good and sorted(tmp_path.iterdir()) == [path]
    assert len(build_sidecar(POLICY, state_file=path).window) == 400
