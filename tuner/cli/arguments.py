"""The argparse types several commands share: counts, amounts and block sizes."""

from __future__ import annotations

import argparse

__all__ = ["block_size_arg", "non_negative_float", "positive_float", "positive_int"]


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a number above 0."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """An argparse type: a number of at least 0."""
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of at least 0, got {text}")
    return value


def block_size_arg(text: str) -> int:
    """An argparse type: a block size, a power of two."""
    from blocktune.kernels import is_power_of_two

    value = int(text)
    if not is_power_of_two(value):
        raise argparse.ArgumentTypeError(f"block sizes must be powers of two, got {text}")
    return value
