"""The block table the attention kernel reads: a host mirror and its device copy.

The host mirror (`int32[max_seqs, max_blocks_per_seq]`, numpy) is edited by the
engine as sequences grow; `sync()` uploads only the rows that changed, in one
transfer (from pinned memory, non-blocking, on CUDA). The kernel never sees a
partially written table and the host never reads the device one element by
element (docs/architecture.md, "Host bookkeeping, device table").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["BlockTable", "SequenceTooLong"]


class SequenceTooLong(ValueError):
    """A sequence needs more blocks than a block-table row holds."""


class BlockTable:
    """Per-sequence rows of block ids, mirrored on the engine's device."""

    def __init__(
        self,
        max_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> None:
        if max_seqs <= 0 or max_blocks_per_seq <= 0 or block_size <= 0:
            raise ValueError(
                "max_seqs, max_blocks_per_seq and block_size must be positive, got "
                f"{max_seqs}, {max_blocks_per_seq}, {block_size}"
            )
        self.block_size = block_size
        self.device = torch.device(device)
        self.host = np.zeros((max_seqs, max_blocks_per_seq), dtype=np.int32)
        self.lengths = np.zeros(max_seqs, dtype=np.int32)
        self.device_table = torch.zeros(
            (max_seqs, max_blocks_per_seq), dtype=torch.int32, device=self.device
        )
        self._dirty: set[int] = set()

    @property
    def max_seqs(self) -> int:
        return self.host.shape[0]

    @property
    def max_blocks_per_seq(self) -> int:
        return self.host.shape[1]

    @property
    def max_tokens_per_seq(self) -> int:
        return self.max_blocks_per_seq * self.block_size

    def set_row(self, row: int, block_ids: Sequence[int]) -> None:
        """Replace a row's block ids (the rest of the row is zeroed)."""
        if len(block_ids) > self.max_blocks_per_seq:
            raise SequenceTooLong(
                f"row {row} needs {len(block_ids)} blocks "
                f"({len(block_ids) * self.block_size} tokens at block size {self.block_size}) "
                f"but a row holds {self.max_blocks_per_seq} blocks "
                f"({self.max_tokens_per_seq} tokens)"
            )
        self.host[row, : len(block_ids)] = block_ids
        self.host[row, len(block_ids) :] = 0
        self.lengths[row] = len(block_ids)
        self._dirty.add(row)

    def clear_row(self, row: int) -> None:
        self.set_row(row, ())

    def row(self, row: int) -> list[int]:
        return self.host[row, : self.lengths[row]].tolist()

    def sync(self) -> int:
        """Upload the changed rows in one transfer; returns how many rows moved.

        The staged rows carry their row index in an extra first column, so the
        indices travel in the same transfer as the block ids.
        """
        if not self._dirty:
            return 0
        rows = np.fromiter(sorted(self._dirty), dtype=np.int32, count=len(self._dirty))
        staged = torch.from_numpy(np.concatenate([rows[:, None], self.host[rows]], axis=1))
        if self.device.type == "cuda":
            staged = staged.pin_memory().to(self.device, non_blocking=True)
        self.device_table.index_copy_(0, staged[:, 0].long(), staged[:, 1:])
        self._dirty.clear()
        return len(rows)

    def resize(self, max_seqs: int | None = None, max_blocks_per_seq: int | None = None) -> None:
        """Grow either dimension, keeping every row's contents."""
        new_seqs = max_seqs or self.max_seqs
        new_blocks = max_blocks_per_seq or self.max_blocks_per_seq
        if new_seqs < self.max_seqs or new_blocks < self.max_blocks_per_seq:
            raise ValueError(
                f"resize only grows: {self.max_seqs}x{self.max_blocks_per_seq} -> "
                f"{new_seqs}x{new_blocks}"
            )
        host = np.zeros((new_seqs, new_blocks), dtype=np.int32)
        host[: self.max_seqs, : self.max_blocks_per_seq] = self.host
        lengths = np.zeros(new_seqs, dtype=np.int32)
        lengths[: self.max_seqs] = self.lengths
        self.host, self.lengths = host, lengths
        self.device_table = torch.from_numpy(host.copy()).to(self.device)
        self._dirty.clear()

    def slot_mapping(self, row: int, positions: Sequence[int] | np.ndarray) -> np.ndarray:
        """Physical slots of a row's logical token positions (block id * B + offset)."""
        pos = np.asarray(positions, dtype=np.int64)
        blocks = pos // self.block_size
        if pos.size and blocks.max() >= self.lengths[row]:
            raise SequenceTooLong(
                f"row {row}: position {int(pos.max())} is past its "
                f"{int(self.lengths[row])} blocks of {self.block_size} tokens"
            )
        return self.host[row, blocks].astype(np.int64) * self.block_size + pos % self.block_size
