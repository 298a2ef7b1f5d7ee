"""Host bookkeeping cost of the BlockManager per block size (a benchmark, not a test).

Replays the request lengths of the Azure LLM conversation trace: up to
`--batch` sequences run at once; each is allocated its prompt, grows one
output token per step, and is freed when done. Prints operations per second
and host microseconds per generated token for each block size: the measured
host bookkeeping cost that the selector uses.

    python bench/block_manager.py [--trace CSV] [--limit N] [--batch 64]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd

from blocktune.runtime.block_manager import BlockManager

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[2]
    / "shared/traces/azure_llm_2023/AzureLLMInferenceTrace_conv.csv"
)


def replay(prompts: list[int], outputs: list[int], block_size: int, batch: int) -> dict:
    """Run the trace through one BlockManager; return counts and elapsed seconds."""
    longest = max(p + o for p, o in zip(prompts, outputs, strict=True))
    num_blocks = batch * (-(-longest // block_size)) + 1
    manager = BlockManager(num_blocks, block_size)
    remaining: dict[int, int] = {}
    next_request = operations = generated = 0
    start = time.perf_counter()
    while next_request < len(prompts) or remaining:
        while len(remaining) < batch and next_request < len(prompts):
            manager.allocate(next_request, [0] * prompts[next_request])
            remaining[next_request] = outputs[next_request]
            next_request += 1
            operations += 1
        for seq_id in remaining:
            manager.append_token(seq_id, 0)
            remaining[seq_id] -= 1
        operations += len(remaining)
        generated += len(remaining)
        for seq_id in [s for s, left in remaining.items() if left == 0]:
            manager.free(seq_id)
            del remaining[seq_id]
            operations += 1
    elapsed = time.perf_counter() - start
    manager.check()
    return {"operations": operations, "generated": generated, "elapsed_s": elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Azure-format CSV")
    parser.add_argument("--limit", type=int, default=None, help="use the first N requests")
    parser.add_argument("--batch", type=int, default=64, help="concurrent sequences")
    parser.add_argument(
        "--block-sizes", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256], metavar="B"
    )
    args = parser.parse_args()
    trace = pd.read_csv(args.trace, nrows=args.limit)
    prompts = trace["ContextTokens"].clip(lower=1).astype(int).tolist()
    outputs = trace["GeneratedTokens"].clip(lower=1).astype(int).tolist()
    print(f"{args.trace.name}: {len(prompts)} requests, {sum(outputs)} generated tokens")
    print(f"{'block':>5}  {'ops/s':>12}  {'us/token':>9}")
    for block_size in args.block_sizes:
        result = replay(prompts, outputs, block_size, args.batch)
        ops_per_s = result["operations"] / result["elapsed_s"]
        us_per_token = result["elapsed_s"] / result["generated"] * 1e6
        print(f"{block_size:>5}  {ops_per_s:>12,.0f}  {us_per_token:>9.3f}")


if __name__ == "__main__":
    main()
