"""`blocktune policy check FILE...`: validate policy files and the calibration each names."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["check_policy", "register"]


def check_policy(name_or_path: Path | str) -> tuple[list[str], list[str]]:
    """Every problem of one policy file or bundled policy (schema first, then its
    calibration), and the warnings of a valid one (a calibration for another device)."""
    from blocktune.tuner.config.calibration import (
        CalibrationError,
        calibration_for,
        device_mismatch,
    )
    from blocktune.tuner.config.config_files import ConfigError
    from blocktune.tuner.config.policy import load_policy, policy_path

    try:
        path = policy_path(name_or_path)
        policy = load_policy(path)
    except ConfigError as exc:
        return list(exc.problems), []
    try:
        calibration = calibration_for(policy, path.parent)
        calibration.require(policy.candidates)
    except ConfigError as exc:
        return [f"{path}: calibration: {problem}" for problem in exc.problems], []
    except CalibrationError as exc:
        return [f"{path}: candidates: {exc}"], []
    mismatch = device_mismatch(policy, calibration)
    return [], [] if mismatch is None else [f"{path}: warning: {mismatch}"]


def run_check(args: argparse.Namespace) -> int:
    """Validate policy files: print every problem and exit 1, or print 'ok' (and any
    warning) and exit 0."""
    failed = False
    for name in args.files:
        problems, warnings = check_policy(name)
        for line in problems + warnings:
            print(line)
        if problems:
            failed = True
        else:
            print(f"{name}: ok")
    return 1 if failed else 0


def register(commands: argparse._SubParsersAction) -> None:
    """Add `policy check` to the command line."""
    policy = commands.add_parser("policy", help="work with YAML tuning policies")
    actions = policy.add_subparsers(dest="policy_command", metavar="ACTION", required=True)
    check = actions.add_parser(
        "check",
        help="validate policy files and report every problem",
        description=run_check.__doc__,
    )
    check.add_argument("files", nargs="+", metavar="FILE", help="policy YAML files")
    check.set_defaults(handler=run_check)
