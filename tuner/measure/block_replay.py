"""Drive a real BlockManager with request lengths: the one loop behind replays and timings.

`drive_block_manager` is a plain stepped model of a server: each step admits
requests (by arrival time, or up to a number running at once), allocating
their prompts, appends one token to every running request and frees a
request after its last output token. `replay_block_manager` uses it to
measure a trace's blocks and padding with a pool large enough that nothing
waits; `measure.measure_host` and the BlockManager benchmark time it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from blocktune.runtime.block_manager import BlockManager

__all__ = ["BlockReplayStats", "drive_block_manager", "replay_block_manager"]


def drive_block_manager(
    manager: BlockManager,
    prompts: np.ndarray,
    outputs: np.ndarray,
    *,
    arrivals: np.ndarray | None = None,
    concurrency: int | None = None,
    step_s: float = 0.05,
    on_step: Callable[[int, int], None] | None = None,
) -> int:
    """Serve the requests on `manager` step by step; returns the number of steps.

    With `arrivals` (seconds, sorted) a step of `step_s` admits every request
    that has arrived; with `concurrency` it admits requests in order while
    fewer than that run. Every token has its own id, so no prompt hits a
    prefix cache. `on_step(running, held_tokens)` is called after each step's
    appends, before the finished requests are freed. A pool too small for the
    requests raises `RuntimeError`.
    """
    total = len(prompts)
    remaining: dict[int, int] = {}
    held = steps = next_request = next_token = 0
    now = 0.0
    while next_request < total or remaining:
        if arrivals is not None and not remaining:
            now = max(now, float(arrivals[next_request]))
        while next_request < total and (
            arrivals[next_request] <= now if arrivals is not None else len(remaining) < concurrency
        ):
            prompt = int(prompts[next_request])
            if manager.allocate(next_request, range(next_token, next_token + prompt)) is None:
                raise RuntimeError(f"no room in the pool for request {next_request}'s prompt")
            next_token += prompt
            remaining[next_request] = int(outputs[next_request])
            held += prompt
            next_request += 1
        for seq_id in remaining:
            if not manager.append_token(seq_id, next_token):
                raise RuntimeError(f"no room in the pool for a token of request {seq_id}")
            next_token += 1
            remaining[seq_id] -= 1
        held += len(remaining)
        steps += 1
        if on_step is not None:
            on_step(len(remaining), held)
        for seq_id in [s for s, left in remaining.items() if left == 0]:
            held -= manager.num_tokens(seq_id)
            manager.free(seq_id)
            del remaining[seq_id]
        now += step_s
    return steps


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
    prompts = trace["prompt_tokens"].to_numpy(dtype=np.int64)
    outputs = trace["output_tokens"].to_numpy(dtype=np.int64)
    num_blocks = int((-(-(prompts + outputs) // block_size)).sum()) + 1
    manager = BlockManager(num_blocks, block_size)
    totals = {"peak": 0, "padding": 0, "allocated": 0}

    def account(_running: int, held: int) -> None:
        blocks = num_blocks - manager.num_free_blocks
        totals["peak"] = max(totals["peak"], blocks)
        totals["allocated"] += blocks * block_size
        totals["padding"] += blocks * block_size - held

    steps = drive_block_manager(
        manager,
        prompts,
        outputs,
        arrivals=trace["arrival_s"].to_numpy(dtype=np.float64),
        step_s=step_s,
        on_step=account,
    )
    manager.check()
    return BlockReplayStats(
        block_size=block_size,
        requests=len(prompts),
        steps=steps,
        peak_blocks=totals["peak"],
        peak_slots=totals["peak"] * block_size,
        padding_slot_steps=totals["padding"],
        allocated_slot_steps=totals["allocated"],
    )
