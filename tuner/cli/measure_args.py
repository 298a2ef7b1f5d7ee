"""--threads and --clock: how engine steps are timed, the defaults a shared CPU needs, and
setting torch's thread count."""

from __future__ import annotations

import argparse

__all__ = ["add_measurement_arguments", "measurement_defaults", "set_threads"]


def add_measurement_arguments(parser: argparse.ArgumentParser, *, shared_cpu: bool = False) -> None:
    """--threads and --clock: how engine steps are timed. With `shared_cpu` both default to
    what a shared CPU needs (`measurement_defaults`)."""
    parser.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="torch intra-op threads (default: "
        + (
            "1 with the cpu clock, else torch's own choice)"
            if shared_cpu
            else "torch's own choice)"
        ),
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default=None if shared_cpu else "wall",
        help="time engine steps by the wall clock, or by the timing thread's CPU time, which "
        "leaves out waits for cores that other processes hold (cpu: needs one thread on a "
        "CPU; default: "
        + (
            "cpu on a CPU device unless --threads asks for more, else wall)"
            if shared_cpu
            else "%(default)s)"
        ),
    )


def measurement_defaults(args: argparse.Namespace, device: str) -> None:
    """Fill in --clock and --threads left out: on a CPU the timing thread's CPU time with one
    torch thread (other processes' load does not show as step time), unless --threads asks
    for more; the wall clock elsewhere."""
    if args.clock is None:
        cpu = device == "cpu" and args.threads in (None, 1)
        args.clock = "cpu" if cpu else "wall"
    if args.clock == "cpu" and args.threads is None:
        args.threads = 1


def set_threads(threads: int | None) -> None:
    """Use `threads` torch intra-op threads (None: leave torch's choice)."""
    import torch

    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be at least 1, got {threads}")
        torch.set_num_threads(threads)
