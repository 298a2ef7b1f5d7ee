"""Triton paged attention on a CUDA GPU: correctness, time per block size, bandwidth.

For a Llama-8B-like attention shape (32 query heads, 8 KV heads, head_dim 128,
bf16) and every block size, at contexts 512/4k/32k and batches 1/32/128:

- the Triton kernel against the torch reference (max |difference|, where the
  reference fits in memory);
- the kernel time from `triton.testing.do_bench`;
- the achieved bandwidth (K+V bytes read / time) as a ratio to a
  device-to-device copy measured in the same run.

Block ids are a random permutation, so every block is a scattered read.

    python bench/gpu_kernels.py [--block-sizes 8 16 32 64 128] [--csv rows.csv]
"""

from __future__ import annotations

import csv
import sys

import torch
from result_file import ResultFile, bench_parser

from blocktune.kernels.paged_attention import paged_attention_torch, paged_attention_triton

HEADS, KV_HEADS, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write counted)."""
    from triton.testing import do_bench

    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3)


def main() -> int:
    from triton.testing import do_bench

    parser = bench_parser(__doc__)
    parser.add_argument(
        "--block-sizes", type=int, nargs="+", default=[8, 16, 32, 64, 128], help="block sizes"
    )
    parser.add_argument(
        "--contexts", type=int, nargs="+", default=[512, 4096, 32768], help="tokens a sequence"
    )
    parser.add_argument(
        "--batches", type=int, nargs="+", default=[1, 32, 128], help="sequences a call"
    )
    parser.add_argument("--csv", default=None, help="also write the rows to this CSV file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure", file=sys.stderr)
        return 1
    out = ResultFile(__file__, __doc__, args.results, preformatted=True)
    device = torch.device("cuda")
    copy_bw = copy_bandwidth(device)
    out.print(f"device: {torch.cuda.get_device_name(device)}")
    out.print(f"torch {torch.__version__}, device-to-device copy {copy_bw / 1e9:.0f} GB/s")
    out.print(f"shape: {HEADS} heads, {KV_HEADS} KV heads, head_dim {HEAD_DIM}, bf16")
    header = ["context", "batch", "block_size", "us", "GB_per_s", "vs_copy", "max_abs_err"]
    out.print("{:>7} {:>5} {:>5} {:>9} {:>8} {:>7} {:>11}".format(*header))
    rows = []
    generator = torch.Generator(device=device).manual_seed(0)
    worst_error = 0.0
    for context in args.contexts:
        for batch in args.batches:
            tokens = context * batch
            k = torch.randn(
                tokens, KV_HEADS, HEAD_DIM, device=device, dtype=DTYPE, generator=generator
            )
            v = torch.randn_like(k)
            q = torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=DTYPE, generator=generator)
            lens = torch.full((batch,), context, dtype=torch.int32, device=device)
            for block_size in args.block_sizes:
                num_blocks = tokens // block_size
                table = torch.randperm(num_blocks, device=device, generator=generator)
                table = table.view(batch, context // block_size).to(torch.int32)
                inputs = (q, k, v, table, lens)
                out = paged_attention_triton(*inputs, block_size=block_size)
                error = float("nan")
                if tokens <= 32 * 4096:
                    ref = paged_attention_torch(*inputs, block_size=block_size)
                    error = (out.float() - ref.float()).abs().max().item()
                    worst_error = max(worst_error, error)
                ms = do_bench(
                    lambda inputs=inputs, b=block_size: paged_attention_triton(
                        *inputs, block_size=b
                    )
                )
                bandwidth = 2 * k.numel() * k.element_size() / (ms * 1e-3)
                row = [
                    context,
                    batch,
                    block_size,
                    ms * 1e3,
                    bandwidth / 1e9,
                    bandwidth / copy_bw,
                    error,
                ]
                rows.append(row)
                out.print("{:>7} {:>5} {:>5} {:>9.1f} {:>8.0f} {:>7.2f} {:>11.2e}".format(*row))
            del k, v
            torch.cuda.empty_cache()
    out.print(f"worst |triton - torch| over checked cases: {worst_error:.2e} (bf16)")
    out.write()
    if args.csv:
        with open(args.csv, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(header)
            writer.writerows(rows)
    return 0 if worst_error < 2e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
