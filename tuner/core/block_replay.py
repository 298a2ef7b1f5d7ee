"""Replay request lengths through a real BlockManager and measure its blocks and padding.

A plain stepped model of a server: each step of `step_s` seconds admits the
requests that have arrived (allocating their prompts) and appends one token to
every running request; a request is freed after its last output token. The
pool is large enough that nothing waits, so the figures are the workload's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from blocktune.runtime.block_manager import BlockManager

__all__ = ["BlockReplayStats", "replay_block_manager"]


@dataclass(frozen=True)
class BlockReplayStats:
    """What one block size costs for a trace: peak blocks and padding (slot-steps)."""

    block_size: int
    requests: int
    steps: int
    peak_blocks: int
    peak_slots: int
    padding_slot_steps: int
    allocated_slot_steps: int

    @property
    def padding_ratio(self) -> float:
        """Allocated-but-unused share of KV slots, integrated over time."""
        return self.padding_slot_steps / max(1, self.allocated_slot_steps)


def replay_block_manager(
    trace: pd.DataFrame, block_size: int, *, step_s: float = 0.05
) -> BlockReplayStats:
    """Replay `trace` (arrival_s, prompt_tokens, output_tokens) at one block size."""
    arrivals = trace["arrival_s"].to_numpy(dtype=np.float64)
    prompts = trace["prompt_tokens"].to_numpy(dtype=np.int64)
    outputs = trace["output_tokens"].to_numpy(dtype=np.int64)
    num_blocks = int((-(-(prompts + outputs) // block_size)).sum()) + 1
    manager = BlockManager(num_blocks, block_size)
    remaining: dict[int, int] = {}
    used_slots = 0
    peak_blocks = padding = allocated = steps = 0
    next_request, now = 0, 0.0
    while next_request < len(arrivals) or remaining:
        if not remaining:
            now = max(now, arrivals[next_request])
        while next_request < len(arrivals) and arrivals[next_request] <= now:
            manager.allocate(next_request, [0] * int(prompts[next_request]))
            remaining[next_request] = int(outputs[next_request])
            used_slots += int(prompts[next_request])
            next_request += 1
        for seq_id in remaining:
            manager.append_tokens(seq_id, (0,))
            remaining[seq_id] -= 1
        used_slots += len(remaining)
        blocks = num_blocks - manager.num_free_blocks
        peak_blocks = max(peak_blocks, blocks)
        allocated += blocks * block_size
        padding += blocks * block_size - used_slots
        steps += 1
        for seq_id in [s for s, left in remaining.items() if left == 0]:
            used_slots -= manager.num_tokens(seq_id)
            manager.free(seq_id)
            del remaining[seq_id]
        now += step_s
    manager.check()
    return BlockReplayStats(
        block_size=block_size,
        requests=len(arrivals),
        steps=steps,
        peak_blocks=peak_blocks,
        peak_slots=peak_blocks * block_size,
        padding_slot_steps=padding,
        allocated_slot_steps=allocated,
    )
