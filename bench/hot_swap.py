"""Hot-swap cost per live KV size.

Fills a KV pool with sequences of the Azure LLM conversation trace's lengths,
served the way an engine grows them (up to N at once, one token per step each,
finished ones freed), until the live KV reaches the target size. Then swaps
the block size down (shrink) and up (grow) with the same prepare/commit code
the engine runs, and reports bytes moved, the pause, and the copy throughput
as a ratio to `torch.clone` of the same number of bytes measured in the same
run.

    python bench/hot_swap.py [--device cpu|cuda] [--sizes-mb 64 256 1024]
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from result_file import ResultFile, bench_parser

from blocktune.kernels.cache_ops import copy_blocks
from blocktune.kernels.cpu_attention import default_backend
from blocktune.runtime.block_manager import BlockManager
from blocktune.runtime.block_table import BlockTable
from blocktune.runtime.hot_swap import prepare_swap, write_staged
from blocktune.runtime.kv_cache import KVCache

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[2]
    / "shared/traces/azure_llm_2023/AzureLLMInferenceTrace_conv.csv"
)
# 2 layers x 8 KV heads x head_dim 128, bf16: 8 KiB of K+V per token slot.
SHAPE = {"num_layers": 2, "num_kv_heads": 8, "head_dim": 128}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def populate(
    manager: BlockManager, lengths: pd.DataFrame, target_tokens: int, rng: np.random.Generator
) -> dict[int, int]:
    """Serve requests until the live tokens reach the target; returns tokens per live sequence."""
    order = rng.permutation(len(lengths))
    prompts = lengths["ContextTokens"].to_numpy()[order].clip(1)
    outputs = lengths["GeneratedTokens"].to_numpy()[order].clip(1)
    live: dict[int, int] = {}
    remaining: dict[int, int] = {}
    next_request = 0
    while sum(live.values()) < target_tokens:
        prompt = int(prompts[next_request % len(prompts)])
        if manager.allocate(next_request, [0] * prompt) is not None:
            live[next_request] = prompt
            remaining[next_request] = int(outputs[next_request % len(outputs)])
        next_request += 1
        for seq in list(remaining):
            if manager.append_tokens(seq, (0,)):
                live[seq] += 1
                remaining[seq] -= 1
            if remaining[seq] == 0:
                manager.free(seq)
                del live[seq], remaining[seq]
    return live


def swap(manager, table, kv, new_size, live, rows, backend, align_tokens):
    """Prepare and commit one swap; returns (new manager, new table, result dict)."""
    synchronize(kv.k[0].device)
    start = time.perf_counter()
    prepared = prepare_swap(
        manager,
        table,
        kv,
        new_size,
        tokens={seq: [0] * n for seq, n in live.items()},
        rows=rows,
        max_model_len=32768,
        backend=backend,
        staging_budget_bytes=2**40,
        align=max(1, align_tokens // new_size),
    )
    if prepared.staging is not None:
        write_staged(kv, prepared)
    synchronize(kv.k[0].device)
    pause = time.perf_counter() - start
    plan = prepared.plan
    copy_s = 0.0
    if plan.copies and not plan.staged:  # the copy alone again (it rewrites the same bytes)
        synchronize(kv.k[0].device)
        start = time.perf_counter()
        copy_blocks(kv.k, kv.v, plan.copies, block_size=plan.old_block_size, backend=backend)
        synchronize(kv.k[0].device)
        copy_s = time.perf_counter() - start
    return (
        prepared.manager,
        prepared.table,
        {
            "bytes_moved": prepared.bytes_moved,
            "pause_s": pause,
            "copy_s": copy_s,
            "zero_copy": plan.zero_copy_blocks,
            "copied": plan.copied_blocks,
            "staged": plan.staged,
        },
    )


def clone_throughput(kv: KVCache, num_bytes: int) -> float:
    """Bytes/s of torch.clone over `num_bytes` of the pool, spread over its layers."""
    per_layer = num_bytes // (2 * kv.num_layers)
    slots = max(1, min(kv.num_slots, per_layer // (kv.nbytes // kv.num_slots) * 2 * kv.num_layers))
    device = kv.k[0].device
    synchronize(device)
    start = time.perf_counter()
    copies = [t[:slots].clone() for t in kv.k + kv.v]
    synchronize(device)
    elapsed = time.perf_counter() - start
    return sum(c.numel() * c.element_size() for c in copies) / elapsed


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Azure-format CSV")
    parser.add_argument("--device", default="cpu", help="the pool's device")
    parser.add_argument("--backend", default=None, help="torch, triton or cpu (None: by device)")
    parser.add_argument(
        "--sizes-mb", type=int, nargs="+", default=[64, 256, 1024], help="live KV sizes [MB]"
    )
    parser.add_argument("--block-size", type=int, default=16, help="size before the swaps")
    parser.add_argument(
        "--align",
        type=int,
        default=128,
        help="allocation alignment in tokens, as an engine whose largest candidate is this "
        "(16: no alignment at block size 16)",
    )
    args = parser.parse_args()
    out = ResultFile(__file__, __doc__, args.results, preformatted=True)
    device = torch.device(args.device)
    backend = args.backend or default_backend(device)
    lengths = pd.read_csv(args.trace, usecols=["ContextTokens", "GeneratedTokens"])
    slot_bytes = 2 * SHAPE["num_layers"] * SHAPE["num_kv_heads"] * SHAPE["head_dim"] * 2
    out.print(
        f"device {device}, backend {backend}, {slot_bytes // 1024} KiB of K+V per token, "
        f"Azure conversation lengths, start at block size {args.block_size}"
    )
    header = (
        f"{'live KV':>8}  {'swap':>9}  {'moved':>9}  {'moved/live':>10}  {'pause ms':>9}  "
        f"{'copy GB/s':>9}  {'clone GB/s':>10}  {'ratio':>5}  {'zero-copy/copied':>16}"
    )
    out.print(header)
    for size_mb in args.sizes_mb:
        target_tokens = size_mb * 2**20 // slot_bytes
        num_slots = int(target_tokens * 1.4) // 64 * 64
        kv = KVCache(**SHAPE, num_slots=num_slots, dtype=torch.bfloat16, device=device)
        manager = BlockManager(
            num_slots // args.block_size, args.block_size, align=args.align // args.block_size
        )
        live = populate(manager, lengths, target_tokens, np.random.default_rng(0))
        rows = {seq: row for row, seq in enumerate(live)}
        table = BlockTable(len(rows), 32768 // 8, args.block_size, device)
        for seq, row in rows.items():
            table.set_row(row, manager.block_ids(seq))
        live_bytes = sum(live.values()) * slot_bytes
        # A grow from the served state, then the shrink back.
        for new_size in (args.block_size * 2, args.block_size):
            old_size = manager.block_size
            manager, table, result = swap(
                manager, table, kv, new_size, live, rows, backend, args.align
            )
            moved = result["bytes_moved"]
            copy_rate = moved / (result["copy_s"] or result["pause_s"]) if moved else 0.0
            clone_rate = clone_throughput(kv, moved) if moved else 0.0
            out.print(
                f"{live_bytes / 2**20:>6.0f}MB  {old_size:>3} -> {new_size:<3}  "
                f"{moved / 2**20:>7.1f}MB  {moved / live_bytes:>10.1%}  "
                f"{result['pause_s'] * 1e3:>9.2f}  {copy_rate / 1e9:>9.2f}  "
                f"{clone_rate / 1e9:>10.2f}  "
                f"{(copy_rate / clone_rate if clone_rate else float('nan')):>5.2f}  "
                f"{result['zero_copy']:>7}/{result['copied']:<8}"
            )
        del kv
    out.write()


if __name__ == "__main__":
    main()
