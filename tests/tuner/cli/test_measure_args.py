"""--clock and --threads: the clock and threads a shared CPU needs."""

import argparse

import pytest

from blocktune.tuner.cli import main
from blocktune.tuner.cli.measure_args import add_measurement_arguments, measurement_defaults


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
