"""The flags several commands share: the clock and threads a shared CPU needs."""

import argparse
import json

import pytest

from blocktune.tuner.cli import main
from blocktune.tuner.cli._common import add_measurement_arguments, measurement_defaults


def _parsed(*argv, shared_cpu=True):
    parser = argparse.ArgumentParser()
    add_measurement_arguments(parser, shared_cpu=shared_cpu)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    ("argv", "device", "expected"),
    [
        ((), "cpu", ("cpu", 1)),  # a shared CPU: its own CPU time, one thread
        (("--threads", "4"), "cpu", ("wall", 4)),  # more threads: the CPU clock cannot time them
        (("--clock", "wall"), "cpu", ("wall", None)),
        ((), "cuda", ("wall", None)),
        (("--clock", "cpu"), "cpu", ("cpu", 1)),
    ],
)
def test_validate_times_a_cpu_by_its_own_cpu_time_with_one_thread(argv, device, expected):
    args = _parsed(*argv)
    measurement_defaults(args, device)
    assert (args.clock, args.threads) == expected


def test_calibrate_keeps_the_wall_clock_by_default():
    args = _parsed(shared_cpu=False)
    assert (args.clock, args.threads) == ("wall", None)


def test_validate_help_names_the_rankings_and_the_cpu_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["validate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--rank-by" not in text
    assert "TPOT p50" in text and "TTFT p99" in text
    assert "cpu on a CPU device" in text and "1 with the cpu clock" in text


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
