"""The cpu attention kernel against its source at another commit, alternating call by call.

Builds the cpu kernel library (`kernels/paged_decode.c` with `layer_ops.c` and their header)
as it is in the working tree and as it was at `--baseline` (a git revision whose
`paged_decode` takes the same arguments: the query's and output's row strides came with the
fused layer operators) with the flags the engine uses, then times both on the same decode inputs
(SmolLM2-135M's heads: 9 query and 3 KV heads of 64, block size 32, contexts of 66-139
tokens, one thread), alternating so that the machine's drift falls on both alike. Before
each call it streams through a buffer larger than the caches, so that the call reads K and
V from memory as the engine's calls do (a decode step's weights pass through the caches
between two calls of a layer); `--warm` leaves them in the caches instead, and `--huge`
moves the pool into 2 MiB pages as the worker does. Prints per dtype and batch the median
and fastest call of each, the ratio of the medians and whether the two outputs are
bitwise equal.

    python bench/cpu_kernel_ab.py [--baseline HEAD] [--sequences 8 32] [--calls 300] \\
        [--warm] [--huge]
"""

from __future__ import annotations

import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from result_file import ResultFile, bench_parser

from blocktune.kernels import cpu_library
from blocktune.runtime.huge_pages import collapse_resident_memory

BLOCK_SIZE = 32
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
CONTEXTS = (66, 140)  # the vs_vllm chat workload's contexts while it decodes
EVICT_BYTES = 64 << 20  # more than this machine's caches: a call after it reads from memory


def build(sources: tuple[Path, ...], target: Path) -> ctypes.CDLL:
    """The kernel library compiled from `sources` as the engine compiles it."""
    failure = cpu_library.build(["cc"], target, sources)
    if failure:
        raise SystemExit(failure)
    return cpu_library.open_library(target)


def call(library: ctypes.CDLL, query, keys, values, table, lens) -> torch.Tensor:
    """One call of `library`'s kernel on a decode batch; its output, in the cache's dtype."""
    out = torch.empty(query.shape, dtype=keys.dtype)
    library.paged_decode(
        query.data_ptr(),
        query.stride(0),
        keys.data_ptr(),
        values.data_ptr(),
        int(keys.dtype == torch.bfloat16),
        table.data_ptr(),
        table.stride(0),
        None,
        lens.data_ptr(),
        query.shape[0],
        KV_HEADS,
        HEADS // KV_HEADS,
        HEAD_DIM,
        BLOCK_SIZE,
        HEAD_DIM**-0.5,
        1,
        out.data_ptr(),
        out.stride(0),
    )
    return out


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--baseline", default="HEAD", help="git revision")
    parser.add_argument(
        "--sequences", type=int, nargs="+", default=[8, 32], help="sequences of a batch"
    )
    parser.add_argument("--calls", type=int, default=300, help="calls each")
    parser.add_argument(
        "--warm", action="store_true", help="leave K and V in the caches between calls"
    )
    parser.add_argument("--huge", action="store_true", help="the pool in 2 MiB pages")
    args = parser.parse_args()
    out = ResultFile(__file__, __doc__, args.results, preformatted=True)
    torch.manual_seed(0)
    evict = torch.zeros(EVICT_BYTES // 4)
    repo = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as scratch:
        baseline = Path(scratch) / "baseline"
        baseline.mkdir()
        for path in (*cpu_library.SOURCES, *cpu_library.HEADERS):
            shown = subprocess.run(
                ["git", "show", f"{args.baseline}:kernels/{path.name}"],
                cwd=repo,
                capture_output=True,
                text=True,
                check=False,
            )
            if shown.returncode:
                raise SystemExit(f"--baseline {args.baseline}: {shown.stderr.strip()}")
            (baseline / path.name).write_text(shown.stdout)
        old_sources = tuple(baseline / path.name for path in cpu_library.SOURCES)
        libraries = {
            args.baseline: build(old_sources, Path(scratch) / "baseline.so"),
            "working tree": build(cpu_library.SOURCES, Path(scratch) / "working.so"),
        }
        out.print(f"{'dtype':>9} {'seqs':>4}  " + "  ".join(f"{n:>22}" for n in libraries))
        for dtype in (torch.float32, torch.bfloat16):
            pool_blocks = 4096
            keys = torch.randn(pool_blocks * BLOCK_SIZE, KV_HEADS, HEAD_DIM).to(dtype)
            values = torch.randn_like(keys)
            if args.huge:
                out.print(str(collapse_resident_memory()))
            for sequences in args.sequences:
                lens = torch.randint(*CONTEXTS, (sequences,), dtype=torch.int32)
                width = -(-CONTEXTS[1] // BLOCK_SIZE)
                table = torch.randperm(pool_blocks)[: sequences * width].view(sequences, width)
                table = table.to(torch.int32)
                # The query heads of a fused query/key/value product, rows apart.
                fused = torch.randn(sequences, HEADS + 2 * KV_HEADS, HEAD_DIM).to(dtype)
                query = fused[:, :HEADS]
                times = {name: [] for name in libraries}
                outputs = {}
                for _ in range(args.calls):
                    for name, library in libraries.items():
                        if not args.warm:
                            evict.add_(1.0)
                        start = time.perf_counter()
                        outputs[name] = call(library, query, keys, values, table, lens)
                        times[name].append(time.perf_counter() - start)
                medians = [statistics.median(t) for t in times.values()]
                cells = [
                    f"p50 {1e6 * m:6.0f} min {1e6 * min(t):6.0f} us"
                    for m, t in zip(medians, times.values(), strict=True)
                ]
                old, new = outputs.values()
                out.print(
                    f"{str(dtype).removeprefix('torch.'):>9} {sequences:>4}  "
                    + "  ".join(cells)
                    + f"  new/old {medians[1] / medians[0]:.3f}  bitwise equal: "
                    + ("yes" if torch.equal(old, new) else "no")
                )
    out.write()


if __name__ == "__main__":
    main()
