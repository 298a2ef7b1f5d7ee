"""Decode attention time per block size on the torch backend, against dense attention.

For each block size, a batch of sequences whose KV blocks sit in shuffled order
in the pool is decoded through `paged_attention(backend="torch")` (gather
through the block table, then softmax attention), and the same tokens are
attended with dense attention over contiguous K/V. The ratio is the cost of
paging on this machine, measured in one run (a benchmark, not a test).

The two take turns: each round times a burst of dense calls, then a burst of
paged calls, and keeps each burst's fastest call (its data warm in the cache,
as in the steady state); the figure is the median over the rounds. Load from
elsewhere on the machine then falls on both alike instead of on whichever ran
while it lasted.

    python bench/decode.py [--batch 16] [--context 1024] [--rounds 20]
"""

from __future__ import annotations

import statistics
import time

import torch
from result_file import ResultFile, bench_parser

from blocktune.kernels.paged_attention import paged_attention

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [S, H, D] against contiguous k, v [S, KVH, T, D] with torch's fused attention."""
    out = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)
    return out[:, :, 0]


def paired_times(fns, rounds: int, burst: int) -> list[float]:
    """Seconds per call of each of `fns`: the median over `rounds` of its fastest call in
    a burst of `burst` calls, the functions taking turns round by round."""
    fastest: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, samples in zip(fns, fastest, strict=True):
            times = []
            for _ in range(burst):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            samples.append(min(times))
    return [statistics.median(samples) for samples in fastest]


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--batch", type=int, default=16, help="sequences")
    parser.add_argument("--context", type=int, default=1024, help="tokens of each sequence")
    parser.add_argument("--rounds", type=int, default=20, help="rounds of bursts")
    parser.add_argument("--burst", type=int, default=5, help="calls per round and function")
    parser.add_argument(
        "--block-sizes", type=int, nargs="+", default=[8, 16, 32, 64, 128], help="block sizes"
    )
    args = parser.parse_args()
    out = ResultFile(__file__, __doc__, args.results, preformatted=True)
    generator = torch.Generator().manual_seed(0)
    tokens = args.batch * args.context
    k_dense = torch.randn(args.batch, args.context, KV_HEADS, HEAD_DIM, generator=generator)
    v_dense = torch.randn(args.batch, args.context, KV_HEADS, HEAD_DIM, generator=generator)
    q = torch.randn(args.batch, HEADS, HEAD_DIM, generator=generator)
    # Dense attention gets K/V already laid out as it wants them: [S, KVH, T, D].
    k_heads = k_dense.transpose(1, 2).contiguous()
    v_heads = v_dense.transpose(1, 2).contiguous()
    out.print(
        f"batch {args.batch} x context {args.context}, {HEADS} heads / {KV_HEADS} KV heads, "
        f"head_dim {HEAD_DIM}, fp32, torch backend, {torch.get_num_threads()} threads"
    )
    columns = ("dense ms", "paged ms", "paged/dense", "max |diff|")
    out.print(f"{'block':>5}  " + "  ".join(f"{c:>11}" for c in columns))
    lens = torch.full((args.batch,), args.context, dtype=torch.int32)
    for block_size in args.block_sizes:
        per_seq = args.context // block_size
        order = torch.randperm(tokens // block_size, generator=generator)
        table = order.view(args.batch, per_seq).to(torch.int32)
        # Scatter the dense K/V into the pool through the table: block j of sequence s
        # lands in physical block table[s, j].
        k_pool = torch.empty(tokens, KV_HEADS, HEAD_DIM)
        v_pool = torch.empty_like(k_pool)
        slots = (table.long()[:, :, None] * block_size + torch.arange(block_size)).reshape(-1)
        k_pool[slots] = k_dense.reshape(tokens, KV_HEADS, HEAD_DIM)
        v_pool[slots] = v_dense.reshape(tokens, KV_HEADS, HEAD_DIM)

        def paged(table=table, k_pool=k_pool, v_pool=v_pool, block_size=block_size):
            return paged_attention(q, k_pool, v_pool, table, lens, block_size=block_size)

        def dense():
            return dense_attention(q, k_heads, v_heads)

        dense_s, paged_s = paired_times([dense, paged], args.rounds, args.burst)
        diff = (paged() - dense()).abs().max().item()
        out.print(
            f"{block_size:>5}  {dense_s * 1e3:>11.2f}  {paged_s * 1e3:>11.2f}  "
            f"{paged_s / dense_s:>11.2f}  {diff:>11.1e}"
        )
    out.write()


if __name__ == "__main__":
    main()
