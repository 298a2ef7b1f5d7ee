"""Changing the KV block size of a running engine: plan, prepare, commit.

The pool is a flat slot array, so a block size is only a view
(docs/architecture.md, "The KV pool is a flat slot array"). With k = new/old (or old/new):

- **shrink** B -> B/k: old block i becomes new blocks k*i ... k*i+k-1. Nothing
  moves; only the bookkeeping and the block table are rebuilt.
- **grow** B -> k*B: a sequence's old blocks are taken k at a time ("groups").
  A group whose ids are k*j, k*j+1, ... in order (and, for a sequence's last,
  partial group, whose remaining old blocks of that region are free) becomes
  new block j as it is: no copy. Every other group is copied into a new block
  whose whole region is free in the old layout, so no live data is touched
  before the commit. When such free regions are too few, the moved groups are
  staged in a side buffer (compaction) if `staging_budget_bytes` allows;
  otherwise the swap is rejected and nothing changes.

Prepare builds the new BlockManager (with prefix-cache keys at the new size)
and the new block table without touching the old ones; the caller then swaps
references in one commit. An exception before that leaves the engine as it
was (`rolled_back`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from blocktune.kernels.cache_ops import copy_blocks
from blocktune.runtime.block_manager import BlockManager
from blocktune.runtime.block_table import BlockTable
from blocktune.runtime.kv_cache import KVCache
from blocktune.runtime.swap_result import SwapResult

__all__ = [
    "PreparedSwap",
    "SwapPlan",
    "SwapRejected",
    "SwapResult",
    "SwapTicket",
    "plan_swap",
    "prepare_swap",
    "write_staged",
]


class SwapRejected(Exception):
    """The swap cannot be done now; the message says why. Nothing was changed."""


class SwapTicket:
    """A pending swap; `result()` waits for the engine's next step boundary."""

    def __init__(self, new_block_size: int) -> None:
        self.new_block_size = new_block_size
        self._future: Future[SwapResult] = Future()

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> SwapResult:
        return self._future.result(timeout)

    def resolve(self, result: SwapResult) -> None:
        self._future.set_result(result)

    def fail(self, error: BaseException) -> None:
        self._future.set_exception(error)


@dataclass(frozen=True)
class SwapPlan:
    """New block ids per sequence and the old-size block copies that realise them."""

    old_block_size: int
    new_block_size: int
    layouts: dict[object, list[int]]
    copies: list[tuple[int, int]]  # (src, dst) in old-size block ids
    staged: bool
    zero_copy_blocks: int
    copied_blocks: int


def _shrink_plan(manager: BlockManager, new_size: int) -> SwapPlan:
    factor = manager.block_size // new_size
    layouts = {}
    for seq in manager.sequences():
        count = -(-manager.num_tokens(seq) // new_size)
        sub = [b * factor + i for b in manager.block_ids(seq) for i in range(factor)]
        layouts[seq] = sub[:count]
    unique = {b for blocks in layouts.values() for b in blocks}
    return SwapPlan(manager.block_size, new_size, layouts, [], False, len(unique), 0)


def _grow_plan(
    manager: BlockManager, new_size: int, num_slots: int, staging_blocks: int
) -> SwapPlan:
    old_size = manager.block_size
    factor = new_size // old_size
    num_new = num_slots // new_size
    referenced = {b for seq in manager.sequences() for b in manager.block_ids(seq)}
    groups_of: dict[object, list[tuple[int, ...]]] = {}
    for seq in manager.sequences():
        blocks = manager.block_ids(seq)
        groups_of[seq] = [tuple(blocks[i : i + factor]) for i in range(0, len(blocks), factor)]
    unique_groups = list(dict.fromkeys(g for groups in groups_of.values() for g in groups))

    target: dict[tuple[int, ...], int] = {}
    for group in unique_groups:
        j, offset = divmod(group[0], factor)
        region = range(j * factor, (j + 1) * factor)
        if (
            offset == 0
            and j < num_new
            and group == tuple(region[: len(group)])
            and not any(b in referenced for b in region[len(group) :])
        ):
            target[group] = j
    moved = [g for g in unique_groups if g not in target]
    claimed = set(target.values())
    # Copies before the commit must not touch cached blocks either: after a rollback the
    # old prefix cache still serves them.
    occupied = referenced | manager.cached_blocks()
    free_regions = [
        j
        for j in range(num_new)
        if j not in claimed and not any(b in occupied for b in range(j * factor, (j + 1) * factor))
    ]
    staged = len(moved) > len(free_regions)
    if staged:
        spare = [j for j in range(num_new) if j not in claimed]
        if len(moved) > len(spare):
            raise SwapRejected(
                f"block size {new_size} needs {len(target) + len(moved)} blocks but the pool "
                f"holds {num_new}"
            )
        moved_blocks = sum(len(g) for g in moved)
        if moved_blocks > staging_blocks:
            raise SwapRejected(
                f"only {len(free_regions)} free aligned regions for {len(moved)} moved blocks; "
                f"compaction would stage {moved_blocks} old blocks, over the budget of "
                f"{staging_blocks}"
            )
        destinations = spare
    else:
        destinations = free_regions
    copies = []
    for group, j in zip(moved, destinations, strict=False):
        target[group] = j
        copies += [(src, j * factor + i) for i, src in enumerate(group) if src != j * factor + i]
    layouts = {seq: [target[g] for g in groups] for seq, groups in groups_of.items()}
    return SwapPlan(
        old_size, new_size, layouts, copies, staged, len(unique_groups) - len(moved), len(moved)
    )


def plan_swap(
    manager: BlockManager, new_block_size: int, num_slots: int, staging_blocks: int = 0
) -> SwapPlan:
    """Where every sequence's tokens live at the new block size; raises `SwapRejected`."""
    old = manager.block_size
    if new_block_size == old:
        raise SwapRejected(f"already at block size {old}")
    if new_block_size < old:
        return _shrink_plan(manager, new_block_size)
    return _grow_plan(manager, new_block_size, num_slots, staging_blocks)


@dataclass
class PreparedSwap:
    """Everything the commit installs; the old state is untouched until then."""

    plan: SwapPlan
    manager: BlockManager
    table: BlockTable
    staging: list[tuple[torch.Tensor, torch.Tensor]] | None
    bytes_moved: int


def _stage(kv: KVCache, plan: SwapPlan) -> list[tuple[torch.Tensor, torch.Tensor]]:
    slots = _pair_slots(plan, 0).to(kv.k[0].device)
    return [
        (k.index_select(0, slots), v.index_select(0, slots))
        for k, v in zip(kv.k, kv.v, strict=True)
    ]


def _pair_slots(plan: SwapPlan, side: int) -> torch.Tensor:
    size = plan.old_block_size
    blocks = torch.tensor([pair[side] for pair in plan.copies], dtype=torch.int64)
    return (blocks[:, None] * size + torch.arange(size)[None, :]).reshape(-1)


def write_staged(kv: KVCache, prepared: PreparedSwap) -> None:
    """Commit-time half of a compaction: write the staged blocks to their new places."""
    slots = _pair_slots(prepared.plan, 1).to(kv.k[0].device)
    for layer, (staged_k, staged_v) in enumerate(prepared.staging):
        kv.k[layer].index_copy_(0, slots, staged_k)
        kv.v[layer].index_copy_(0, slots, staged_v)


def prepare_swap(
    manager: BlockManager,
    table: BlockTable,
    kv: KVCache,
    new_block_size: int,
    *,
    tokens: Mapping[object, Sequence[int]],
    rows: Mapping[object, int],
    max_model_len: int,
    backend: str,
    staging_budget_bytes: int = 0,
    align: int = 1,
    fault_hook: Callable[[str], None] | None = None,
) -> PreparedSwap:
    """Plan, copy into free slots (or stage), and build the new manager and table.

    `tokens` gives each sequence's tokens that hold KV; `rows` its block-table
    row; `align` is the new manager's allocation alignment (see BlockManager).
    `fault_hook(phase)` is called at "copy" and "table" (tests inject failures
    there). Raises `SwapRejected` when the swap cannot be done.
    """
    hook = fault_hook or (lambda phase: None)
    slot_bytes = kv.nbytes // kv.num_slots
    plan = plan_swap(
        manager,
        new_block_size,
        kv.num_slots,
        staging_budget_bytes // (slot_bytes * manager.block_size),
    )
    hook("copy")
    staging = None
    if plan.staged:
        staging = _stage(kv, plan)
    elif plan.copies:
        copy_blocks(kv.k, kv.v, plan.copies, block_size=plan.old_block_size, backend=backend)
    hook("table")
    new_manager = BlockManager.from_sequences(
        kv.num_slots // new_block_size,
        new_block_size,
        {seq: (plan.layouts[seq], tokens[seq]) for seq in manager.sequences()},
        enable_prefix_caching=manager.enable_prefix_caching,
        align=align,
    )
    new_table = BlockTable(
        table.max_seqs, -(-max_model_len // new_block_size), new_block_size, table.device
    )
    for seq, row in rows.items():
        new_table.set_row(row, plan.layouts[seq])
    new_table.sync()
    bytes_moved = len(plan.copies) * plan.old_block_size * slot_bytes
    return PreparedSwap(plan, new_manager, new_table, staging, bytes_moved)
