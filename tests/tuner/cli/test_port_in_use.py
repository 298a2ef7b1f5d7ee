"""A port in use ends `blocktune worker` and `blocktune serve` at once, naming host:port:
before the worker loads its model, before the sidecar is built or logs that it serves."""

import logging
import socket
from pathlib import Path

import pytest

from blocktune.tuner.cli import main

DEFAULT = Path(__file__).resolve().parents[3] / "policies" / "default.yaml"


@pytest.fixture
def taken_port():
    """A port another server listens on, on 127.0.0.1."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield server.getsockname()[1]


def test_the_worker_checks_its_port_before_it_loads_the_model(taken_port, capsys):
    # A model that could not load: the port's refusal must come first.
    assert main(["worker", "--model", "no/such/model", "--port", str(taken_port)]) == 2
    error = capsys.readouterr().err
    assert f"blocktune worker: cannot listen on 127.0.0.1:{taken_port}: " in error
    assert "another process listens there" in error and "no/such/model" not in error


def test_the_sidecar_checks_its_port_before_it_is_built_or_says_it_serves(
    taken_port, capsys, caplog, monkeypatch
):
    def built(*_args, **_kwargs):
        raise AssertionError("the sidecar was built")

    monkeypatch.setattr("blocktune.tuner.sidecar.assembly.build_sidecar", built)
    monkeypatch.delenv("BLOCKTUNE_TOKEN", raising=False)
    with caplog.at_level(logging.INFO):
        code = main(["serve", "--policy", str(DEFAULT), "--port", str(taken_port)])
    assert code == 2
    assert f"blocktune serve: cannot listen on 127.0.0.1:{taken_port}: " in capsys.readouterr().err
    assert "serving" not in caplog.text


@pytest.mark.parametrize("command", ["worker", "serve"])
def test_a_port_out_of_range_is_refused_by_the_parser(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--port", "70000"])
    assert "port must be in 1..65535, got 70000" in capsys.readouterr().err
