"""The outcome of a block-size swap, shared by the engine and anything that asks it for one.

Plain Python (no torch), so the sidecar can read a worker's answer without
loading the engine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

__all__ = ["SwapResult"]


@dataclass(frozen=True)
class SwapResult:
    """The outcome of one block-size swap."""

    status: Literal["done", "rejected", "rolled_back"]
    old_block_size: int
    new_block_size: int
    zero_copy_blocks: int = 0
    copied_blocks: int = 0
    bytes_moved: int = 0
    pause_s: float = 0.0
    reason: str = ""

    def to_dict(self) -> dict:
        return asdict(self)
