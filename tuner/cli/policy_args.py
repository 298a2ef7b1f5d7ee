"""`--policy` and `--calibration`: the policy a command runs under, the calibration it
prices block sizes with, and loading the two."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from blocktune.tuner.config.defaults import DEFAULT_POLICY

if TYPE_CHECKING:
    from blocktune.tuner.config.calibration import Calibration
    from blocktune.tuner.config.policy import Policy

__all__ = ["add_calibration_argument", "add_policy_argument", "load_policy_and_calibration"]


def add_policy_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """--policy FILE|NAME: a policy YAML file or a bundled policy's name, the bundled
    `DEFAULT_POLICY` where not given; `what` says what the command takes from it."""
    parser.add_argument(
        "--policy",
        default=DEFAULT_POLICY,
        metavar="FILE|NAME",
        help=f"policy YAML file, or the name of a bundled policy (default, long_document, ...): "
        f"{what} (default: %(default)s)",
    )


def add_calibration_argument(parser: argparse.ArgumentParser) -> None:
    """--calibration FILE: a calibration YAML instead of the one the policy names."""
    parser.add_argument(
        "--calibration",
        metavar="FILE",
        help="calibration YAML to use instead of the policy's (for example one written by "
        "`blocktune calibrate --engine`)",
    )


def load_policy_and_calibration(
    name_or_path: str, calibration: str | None = None
) -> tuple[Policy, Calibration]:
    """The policy (a file or a bundled name) and the calibration file `calibration`, or
    else the one the policy names, whose relative paths start at the policy file's
    folder. Raises `ConfigError` or `CalibrationError`."""
    from blocktune.tuner.config.calibration import calibration_for, load_calibration
    from blocktune.tuner.config.policy import load_policy, policy_path

    path = policy_path(name_or_path)
    policy = load_policy(path)
    if calibration is not None:
        return policy, load_calibration(calibration)
    return policy, calibration_for(policy, Path(path).parent)
