"""Host bookkeeping cost of the BlockManager per block size.

Replays the request lengths of the Azure LLM conversation trace: up to
`--batch` sequences run at once; each is allocated its prompt, grows one
output token per step, and is freed when done. Prints the host microseconds
per generated token for each block size: the bookkeeping cost that the
selector uses.

    python bench/block_manager.py [--trace CSV] [--limit N] [--batch 64]

`make bench` runs it with the defaults.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pandas as pd
from result_file import ResultFile, bench_parser

from blocktune.runtime.block_manager import BlockManager
from blocktune.tuner.measure.block_replay import drive_block_manager

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[2]
    / "shared/traces/azure_llm_2023/AzureLLMInferenceTrace_conv.csv"
)


def replay(prompts: list[int], outputs: list[int], block_size: int, batch: int) -> dict:
    """Run the trace through one BlockManager; return the generated tokens and seconds."""
    longest = max(p + o for p, o in zip(prompts, outputs, strict=True))
    manager = BlockManager(batch * (-(-longest // block_size)) + 1, block_size)
    start = time.perf_counter()
    drive_block_manager(manager, np.asarray(prompts), np.asarray(outputs), concurrency=batch)
    elapsed = time.perf_counter() - start
    manager.check()
    return {"generated": sum(outputs), "elapsed_s": elapsed}


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Azure-format CSV")
    parser.add_argument("--limit", type=int, default=None, help="use the first N requests")
    parser.add_argument("--batch", type=int, default=64, help="concurrent sequences")
    parser.add_argument(
        "--block-sizes",
        type=int,
        nargs="+",
        default=[8, 16, 32, 64, 128, 256],
        metavar="B",
        help="block sizes to replay",
    )
    args = parser.parse_args()
    out = ResultFile(__file__, __doc__, args.results, preformatted=True)
    trace = pd.read_csv(args.trace, nrows=args.limit)
    prompts = trace["ContextTokens"].clip(lower=1).astype(int).tolist()
    outputs = trace["GeneratedTokens"].clip(lower=1).astype(int).tolist()
    out.print(
        f"{args.trace.name}: {len(prompts)} requests, {sum(outputs)} generated tokens, "
        f"batch {args.batch}"
    )
    out.print(f"{'block':>5}  {'us/token':>9}")
    for block_size in args.block_sizes:
        result = replay(prompts, outputs, block_size, args.batch)
        us_per_token = result["elapsed_s"] / result["generated"] * 1e6
        out.print(f"{block_size:>5}  {us_per_token:>9.3f}")
    out.write()


if __name__ == "__main__":
    main()
