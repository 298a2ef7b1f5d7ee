"""A state file's durations and times that a sidecar cannot use: a restart longer than any
duration the policy accepts, a switch or a save in the future; each set aside at start."""

import json
import sys
import time
from pathlib import Path

import pytest

from blocktune.tuner.config.policy import ActuatorSettings, load_policy
from blocktune.tuner.sidecar.assembly import build_sidecar
from blocktune.tuner.sidecar.state import MAX_CLOCK_SKEW_S

DEFAULT = Path(__file__).resolve().parents[3] / "policies" / "default.yaml"
POLICY = load_policy(DEFAULT)
# a restarting actuator (its command is never run here): the sidecar prices saved restarts
RESTARTING = POLICY.model_copy(
    update={
        "actuator": ActuatorSettings(kind="command", command=[sys.executable, "{block_size}"]),
    }
)


def saved_state(path: Path, **changes: object) -> str:
    """A restarting sidecar's saved state at `path`, with `changes`; its text."""
    sidecar = build_sidecar(RESTARTING, state_file=path)
    sidecar.save_state()
    text = json.dumps({**json.loads(path.read_text()), **changes})
    path.write_text(text)
    return text


def start_from(path: Path, text: str):
    """Start a restarting sidecar from the state file at `path`, which must be set aside."""
    sidecar = build_sidecar(RESTARTING, state_file=path)
    try:
        sidecar.start()
        assert not path.exists() and sidecar.state_file.set_aside_as.read_text() == text
        assert not sidecar._stats.restarts_s
    finally:
        sidecar.stop()
    return sidecar


def test_a_saved_restart_within_the_bound_is_priced(tmp_path):
    path = tmp_path / "state.json"
    saved_state(path, restarts_s=[12.5, 7.5])
    sidecar = build_sidecar(RESTARTING, state_file=path)
    assert list(sidecar._stats.restarts_s) == [12.5, 7.5]
    assert sidecar.selector.policy.restart.total_seconds() == 10.0


@pytest.mark.parametrize("seconds", [1e14, 1e300, 365 * 86400 + 1])
def test_a_saved_restart_longer_than_any_duration_is_set_aside(tmp_path, seconds, caplog):
    path = tmp_path / "state.json"
    text = saved_state(path, restarts_s=[5.0, seconds, seconds])  # their median
    with caplog.at_level("INFO", logger="blocktune.sidecar"):
        start_from(path, text)
    problems = [json.loads(r.message).get("problem", "") for r in caplog.records]
    assert any(
        "restarts_s[1]: Input should be less than or equal to 31536000" in problem
        for problem in problems
    ), problems


@pytest.mark.parametrize("field", ["last_switch_at", "saved_at"])
def test_a_time_in_the_future_is_set_aside(tmp_path, field, caplog):
    path = tmp_path / "state.json"
    text = saved_state(path, **{field: time.time() + 2 * MAX_CLOCK_SKEW_S})
    with caplog.at_level("INFO", logger="blocktune.sidecar"):
        sidecar = start_from(path, text)
    assert sidecar.selector.last_switch is None
    problems = [json.loads(r.message).get("problem", "") for r in caplog.records]
    assert any(field in problem and "future" in problem for problem in problems), problems


@pytest.mark.parametrize("field", ["last_switch_at", "saved_at"])
def test_a_time_just_ahead_within_the_clock_skew_is_kept(tmp_path, field):
    path = tmp_path / "state.json"
    at = time.time() + MAX_CLOCK_SKEW_S / 2
    saved_state(path, **{field: at})
    sidecar = build_sidecar(RESTARTING, state_file=path)
    assert path.exists() and sidecar.state_file.set_aside_as is None
    if field == "last_switch_at":
        assert sidecar.selector.last_switch == at
