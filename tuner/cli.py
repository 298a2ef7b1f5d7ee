"""The `blocktune` command line.

Each command lives in its own module with a `register(commands)` function that
adds its sub-parser and sets `handler`; heavy imports stay inside the handlers
so `blocktune --help` is fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from blocktune import __version__

__all__ = ["build_parser", "main"]

COMMAND_MODULES = (
    "blocktune.tuner.demo",
    "blocktune.tuner.generate_cmd",
    "blocktune.tuner.trace_cmd",
    "blocktune.tuner.recommend",
    "blocktune.tuner.replay_cmd",
    "blocktune.tuner.policy_cli",
    "blocktune.tuner.calibrate_cli",
    "blocktune.tuner.worker_cmd",
    "blocktune.tuner.serve_cmd",
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


if __name__ == "__main__":
    sys.exit(main())
