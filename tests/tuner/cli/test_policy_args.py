"""--policy: every command that takes one runs on the bundled default without it."""

import json

import pytest

from blocktune.tuner.cli import main


@pytest.mark.parametrize("command", ["recommend", "replay", "validate", "serve"])
def test_every_command_that_takes_a_policy_runs_on_the_bundled_default_without_one(command):
    from blocktune.tuner.cli import build_parser

    argv = [command] if command == "serve" else [command, "synthetic"]
    assert build_parser().parse_args(argv).policy == "default"


def test_recommend_without_a_policy_decides_on_the_default_one(capsys):
    from blocktune.tuner.config.policy import load_policy

    argv = ["recommend", "synthetic", "--phase", "day", "--last", "300", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert [c["block_size"] for c in report["candidates"]] == list(load_policy().candidates)
    assert report["recommended_block_size"] in load_policy().candidates
