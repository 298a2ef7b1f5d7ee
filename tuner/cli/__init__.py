"""The `blocktune` command line.

Each command lives in its own module with a `register(commands)` function that
adds its sub-parser and sets `handler`; heavy imports stay inside the handlers
so `blocktune --help` is fast.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

from blocktune import __version__

__all__ = ["build_parser", "main"]

COMMAND_MODULES = (
    "blocktune.tuner.cli.demo",
    "blocktune.tuner.cli.generate",
    "blocktune.tuner.cli.trace",
    "blocktune.tuner.cli.recommend",
    "blocktune.tuner.cli.replay",
    "blocktune.tuner.cli.validate",
    "blocktune.tuner.cli.sweep",
    "blocktune.tuner.cli.policy",
    "blocktune.tuner.cli.calibrate",
    "blocktune.tuner.cli.worker",
    "blocktune.tuner.cli.serve",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="blocktune",
        description=(
            "Workload-adaptive block-size tuning for paged KV caches: measure what each "
            "KV block size costs a workload, pick one, and change it while serving."
        ),
    )
    parser.add_argument("--version", action="version", version=f"blocktune {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return args.handler(args)
