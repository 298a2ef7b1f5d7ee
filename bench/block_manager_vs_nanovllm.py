"""Host bookkeeping per generated token: blocktune's BlockManager beside nano-vllm's.

Both managers run the same loop over a trace's request lengths: up to `--batch`
sequences at once; each is allocated its prompt, grows one output token at a
time, and is freed when done. Every request has its own token ids, so no prompt
hits a prefix cache. nano-vllm always hashes full blocks (xxhash), so its fair
counterpart is blocktune with prefix caching; blocktune without it is shown too.
Prints microseconds per generated token, best of `--repeats` runs, for each
block size: nano-vllm, blocktune with prefix caching, their ratio, and blocktune
without prefix caching ("uncached"). A benchmark, not a test.

NANOVLLM_DIR is a folder holding nano-vllm's `nanovllm` package (its
`engine/block_manager.py`, `engine/sequence.py` and `sampling_params.py`
suffice); nano-vllm needs `xxhash` and `numpy`.

    python bench/block_manager_vs_nanovllm.py NANOVLLM_DIR TRACE [--limit 3000] [--batch 64]
"""

from __future__ import annotations

import importlib.util
import sys
import time
import types
from pathlib import Path

import numpy as np
from result_file import ResultFile, bench_parser

from blocktune.runtime.block_manager import BlockManager
from blocktune.traces import load_trace
from blocktune.tuner.measure.block_replay import drive_block_manager


def import_nanovllm(folder: Path) -> tuple[type, type]:
    """nano-vllm's BlockManager and Sequence classes, imported from `folder`."""
    if importlib.util.find_spec("xxhash") is None:
        sys.exit("nano-vllm's BlockManager needs xxhash: pip install xxhash (benchmark only)")
    package = folder / "nanovllm"
    if not (package / "engine" / "block_manager.py").is_file():
        sys.exit(f"{folder}: no nanovllm/engine/block_manager.py there")
    sys.modules.setdefault("nanovllm", types.ModuleType("nanovllm")).__path__ = [str(package)]
    from nanovllm.engine.block_manager import BlockManager as NanoBlockManager
    from nanovllm.engine.sequence import Sequence as NanoSequence

    return NanoBlockManager, NanoSequence


def pool_blocks(lengths: list[tuple[int, int]], block_size: int, batch: int) -> int:
    """Enough blocks for `batch` of the longest request: no run ever waits for room."""
    longest = max(prompt + output for prompt, output in lengths)
    return batch * -(-longest // block_size) + 1


def run_blocktune(
    lengths: list[tuple[int, int]], block_size: int, batch: int, prefix_caching: bool
) -> float:
    """Seconds per generated token through blocktune's BlockManager."""
    manager = BlockManager(
        pool_blocks(lengths, block_size, batch), block_size, enable_prefix_caching=prefix_caching
    )
    prompts, outputs = (np.array(column) for column in zip(*lengths, strict=True))
    start = time.perf_counter()
    drive_block_manager(manager, prompts, outputs, concurrency=batch)
    elapsed = time.perf_counter() - start
    manager.check()
    return elapsed / int(outputs.sum())


def run_nanovllm(
    lengths: list[tuple[int, int]], block_size: int, batch: int, classes: tuple[type, type]
) -> float:
    """Seconds per generated token through nano-vllm's BlockManager, driven as its
    scheduler drives it (reserve a slot, then hash what the step filled)."""
    nano_manager, nano_sequence = classes
    nano_sequence.block_size = block_size
    manager = nano_manager(pool_blocks(lengths, block_size, batch), block_size)
    remaining: dict[object, int] = {}
    next_request = next_token = generated = 0
    start = time.perf_counter()
    while next_request < len(lengths) or remaining:
        while len(remaining) < batch and next_request < len(lengths):
            prompt, output = lengths[next_request]
            seq = nano_sequence(list(range(next_token, next_token + prompt)))
            next_token += prompt
            num_cached_blocks = manager.can_allocate(seq)
            if num_cached_blocks == -1:
                raise RuntimeError("nano-vllm: no room for a prompt")
            manager.allocate(seq, num_cached_blocks)
            seq.num_scheduled_tokens = seq.num_tokens - seq.num_cached_tokens
            manager.hash_blocks(seq)
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            remaining[seq] = output
            next_request += 1
        for seq in remaining:
            seq.append_token(next_token)
            next_token += 1
            if not manager.can_append(seq):
                raise RuntimeError("nano-vllm: no room for a token")
            manager.may_append(seq)
            seq.num_scheduled_tokens = 1
            manager.hash_blocks(seq)
            seq.num_cached_tokens += 1
            seq.num_scheduled_tokens = 0
            remaining[seq] -= 1
        generated += len(remaining)
        for seq in [s for s, left in remaining.items() if left == 0]:
            manager.deallocate(seq)
            del remaining[seq]
    return (time.perf_counter() - start) / generated


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("nanovllm_dir", type=Path, help="folder holding the nanovllm package")
    parser.add_argument("trace", type=Path, help="a request trace (e.g. Azure LLM 2023 CSV)")
    parser.add_argument("--limit", type=int, default=3000, help="use the first N requests")
    parser.add_argument("--batch", type=int, default=64, help="concurrent sequences")
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure; the best is kept")
    parser.add_argument(
        "--block-sizes", type=int, nargs="+", default=[8, 16, 32, 256], help="block sizes"
    )
    args = parser.parse_args()
    out = ResultFile(__file__, __doc__, args.results, preformatted=True)
    classes = import_nanovllm(args.nanovllm_dir)
    frame = load_trace(args.trace).frame.head(args.limit)
    lengths = list(
        zip(frame["prompt_tokens"].tolist(), frame["output_tokens"].tolist(), strict=True)
    )
    out.print(
        f"{args.trace.name}: {len(lengths)} requests, "
        f"{sum(o for _, o in lengths)} generated tokens, batch {args.batch}, "
        f"best of {args.repeats}; microseconds per generated token"
    )
    out.print(f"{'block':>5}  {'nano-vllm':>9}  {'blocktune':>9}  {'ratio':>5}  {'uncached':>8}")
    for block_size in args.block_sizes:
        runs = {"nano": [], "cached": [], "plain": []}
        for _ in range(args.repeats):
            runs["nano"].append(run_nanovllm(lengths, block_size, args.batch, classes))
            runs["cached"].append(run_blocktune(lengths, block_size, args.batch, True))
            runs["plain"].append(run_blocktune(lengths, block_size, args.batch, False))
        nano, cached, plain = (min(runs[k]) * 1e6 for k in ("nano", "cached", "plain"))
        ratio = cached / nano
        out.print(f"{block_size:>5}  {nano:>9.3f}  {cached:>9.3f}  {ratio:>5.2f}  {plain:>8.3f}")
    out.write()


if __name__ == "__main__":
    main()
