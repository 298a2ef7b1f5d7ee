"""Measure a calibration on this machine (what `blocktune calibrate` runs).

For each block size B it times the paged decode attention kernel over a grid
of context lengths and batch sizes (blocks placed in shuffled physical order,
as after a while of serving), the BlockManager's host bookkeeping per generated
token, and, for the device, block-copy bandwidth, read bandwidth and matmul
throughput. Kernel times are fitted by non-negative least squares over all
block sizes at once:

    t(B, batch, ctx) = launch_s[B] + batch * (per_block_s * ceil(ctx / B) + per_token_s[B] * ctx)

Within one B, blocks and tokens are almost proportional, so the per-block
coefficient is only identifiable across block sizes: it is shared, and each B
keeps its own launch and per-token coefficients.

torch is imported inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

import numpy as np

from blocktune.tuner.config.calibration import (
    Calibration,
    KernelCoefficients,
    Provenance,
)
from blocktune.tuner.config.policy import DTYPE_BYTES, KVShape

__all__ = ["Grid", "default_grid", "measure_calibration", "measure_host", "measured_provenance"]


@dataclass(frozen=True)
class Grid:
    """What to measure: block sizes, kernel grid and shape, and workload sizes."""

    block_sizes: tuple[int, ...]
    context_lens: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    repeats: int
    host_requests: int
    host_concurrency: int
    copy_pairs: int
    bandwidth_bytes: int
    matmul_size: int


def default_grid(device: str, *, quick: bool, block_sizes: tuple[int, ...]) -> Grid:
    """The full grid for a CUDA device or a CPU, or a tiny one (`quick`) for smoke runs."""
    shape = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128}
    if quick:
        return Grid(
            block_sizes, (37, 300), (1, 4), 8, 2, 64, "float32" if device == "cpu" else "bfloat16",
            repeats=3, host_requests=120, host_concurrency=16, copy_pairs=64,
            bandwidth_bytes=1 << 24, matmul_size=256,
        )  # fmt: skip
    if device == "cuda":
        return Grid(
            block_sizes, (37, 200, 1000, 3000, 8000), (8, 32, 128), **shape, dtype="bfloat16",
            repeats=20, host_requests=3000, host_concurrency=64, copy_pairs=8192,
            bandwidth_bytes=1 << 31, matmul_size=8192,
        )  # fmt: skip
    return Grid(
        block_sizes, (37, 200, 1000), (2, 8), **shape, dtype="float32",
        repeats=5, host_requests=1000, host_concurrency=64, copy_pairs=512,
        bandwidth_bytes=1 << 27, matmul_size=1024,
    )  # fmt: skip


def _timer(device: str) -> Callable[[Callable[[], object], int], float]:
    """A function timing `fn` (median of `repeats` calls, seconds) after one warm-up call."""
    import torch

    def timed(fn: Callable[[], object], repeats: int) -> float:
        fn()
        samples = []
        for _ in range(repeats):
            if device == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3)
            else:
                begin = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - begin)
        return float(np.median(samples))

    return timed


def measure_kernel(grid: Grid, device: str, backend: str) -> dict[int, KernelCoefficients]:
    """Time paged decode attention over the grid and fit the coefficients per block size."""
    import torch
    from scipy.optimize import nnls

    from blocktune.kernels.paged_attention import paged_attention, warmup

    dtype = getattr(torch, grid.dtype)
    timed = _timer(device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    torch.manual_seed(0)
    warmup(
        grid.block_sizes,
        num_heads=grid.num_heads,
        num_kv_heads=grid.num_kv_heads,
        head_dim=grid.head_dim,
        dtype=dtype,
        device=device,
        backend=backend,
    )
    rows, times = [], []
    k = len(grid.block_sizes)
    for i, block_size in enumerate(grid.block_sizes):
        for batch in grid.batch_sizes:
            for ctx in grid.context_lens:
                per_seq = -(-ctx // block_size)
                num_blocks = batch * per_seq
                table = torch.randperm(num_blocks, generator=gen).view(batch, per_seq)
                slots = (num_blocks * block_size, grid.num_kv_heads, grid.head_dim)
                key = torch.randn(slots, device=device, dtype=dtype)
                value = torch.randn(slots, device=device, dtype=dtype)
                query = torch.randn((batch, grid.num_heads, grid.head_dim), device=device)
                query = query.to(dtype)
                table = table.to(device=device, dtype=torch.int32)
                lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)

                def call(q=query, kc=key, vc=value, t=table, n=lens, b=block_size) -> object:
                    return paged_attention(q, kc, vc, t, n, block_size=b, backend=backend)

                times.append(timed(call, grid.repeats))
                row = np.zeros(2 * k + 1)
                row[i] = 1.0  # launch_s[B]
                row[k + i] = batch * ctx  # per_token_s[B]
                row[2 * k] = batch * per_seq  # shared per_block_s
                rows.append(row)
    solution, _ = nnls(np.array(rows), np.array(times))
    return {
        b: KernelCoefficients(
            launch_s=float(solution[i]),
            per_block_s=float(solution[2 * k]),
            per_token_s=float(solution[k + i]),
        )
        for i, b in enumerate(grid.block_sizes)
    }


def measure_host(block_size: int, *, requests: int, concurrency: int, seed: int = 0) -> float:
    """Seconds of BlockManager bookkeeping per generated token at `block_size`.

    Replays a seeded mix of lengths (prompts 16-2048, outputs 16-512 tokens,
    log-uniform) with `concurrency` sequences at once: allocate the prompt,
    append one token per step, free when done.
    """
    from blocktune.runtime.block_manager import BlockManager
    from blocktune.tuner.measure.block_replay import drive_block_manager

    rng = np.random.default_rng(seed)
    prompts = np.exp(rng.uniform(np.log(16), np.log(2048), requests)).astype(int)
    outputs = np.exp(rng.uniform(np.log(16), np.log(512), requests)).astype(int)
    longest = int((prompts + outputs).max())
    manager = BlockManager(concurrency * (-(-longest // block_size)) + 1, block_size)
    begin = time.perf_counter()
    drive_block_manager(manager, prompts, outputs, concurrency=concurrency)
    return (time.perf_counter() - begin) / int(outputs.sum())


def measure_copy_bandwidth(grid: Grid, device: str, backend: str) -> float:
    """Bytes per second that `copy_blocks` moves (each byte read once and written once)."""
    import torch

    from blocktune.kernels.cache_ops import copy_blocks

    block_size, layers = 16, 4
    slots = (2 * grid.copy_pairs * block_size, grid.num_kv_heads, grid.head_dim)
    dtype = getattr(torch, grid.dtype)
    keys = [torch.zeros(slots, dtype=dtype, device=device) for _ in range(layers)]
    values = [torch.zeros(slots, dtype=dtype, device=device) for _ in range(layers)]
    pairs = torch.stack(
        [torch.arange(grid.copy_pairs), torch.arange(grid.copy_pairs) + grid.copy_pairs], dim=1
    ).to(device)
    seconds = _timer(device)(
        lambda: copy_blocks(keys, values, pairs, block_size=block_size, backend=backend),
        grid.repeats,
    )
    moved = 2 * layers * grid.copy_pairs * block_size * grid.num_kv_heads * grid.head_dim
    return moved * DTYPE_BYTES[grid.dtype] / seconds


def measure_read_bandwidth(grid: Grid, device: str) -> float:
    """Bytes per second a full reduction reads (a stand-in for streaming the weights)."""
    import torch

    dtype = getattr(torch, grid.dtype)
    data = torch.ones(grid.bandwidth_bytes // DTYPE_BYTES[grid.dtype], dtype=dtype, device=device)
    seconds = _timer(device)(lambda: data.sum(dtype=torch.float32), grid.repeats)
    return grid.bandwidth_bytes / seconds


def measure_matmul_flops(grid: Grid, device: str) -> float:
    """FLOP/s of a square matmul in the grid's dtype (a stand-in for prefill)."""
    import torch

    n = grid.matmul_size
    dtype = getattr(torch, grid.dtype)
    a = torch.randn((n, n), device=device).to(dtype)
    b = torch.randn((n, n), device=device).to(dtype)
    seconds = _timer(device)(lambda: a @ b, grid.repeats)
    return 2 * n**3 / seconds


def _device_name(device: str) -> str:
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"CPU {platform.processor() or platform.machine()} ({platform.system()})"


def measured_provenance(device: str, backend: str, grid: object, notes: str) -> Provenance:
    """The provenance of a measurement made now on `device`: its name, the torch and triton
    versions, the date and `grid` (a dataclass) as the record of what was measured."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    grid_record = {
        key: list(value) if isinstance(value, tuple) else value
        for key, value in asdict(grid).items()
        if value is not None  # a limit the grid does not have
    }
    return Provenance(
        kind="measured",
        device=_device_name(device),
        date=datetime.now(timezone.utc).replace(microsecond=0),
        torch=torch.__version__,
        triton=triton_version,
        backend=backend,
        grid=grid_record,
        notes=notes,
    )


def measure_calibration(
    grid: Grid, device: str, *, progress: Callable[[str], None] = lambda _: None
) -> Calibration:
    """Run every measurement on `device` with its `default_backend` (Triton kernels on
    CUDA; on a CPU the C kernel where it builds, torch operators otherwise)."""
    from blocktune.kernels.cpu_attention import default_backend

    backend = default_backend(device)
    progress(f"kernel: {len(grid.block_sizes)} block sizes x {len(grid.context_lens)} contexts")
    kernel = measure_kernel(grid, device, backend)
    progress("host bookkeeping per token")
    host = {
        b: measure_host(b, requests=grid.host_requests, concurrency=grid.host_concurrency)
        for b in grid.block_sizes
    }
    progress("copy, read bandwidth and matmul throughput")
    copy = measure_copy_bandwidth(grid, device, backend)
    read = measure_read_bandwidth(grid, device)
    flops = measure_matmul_flops(grid, device)
    return Calibration(
        provenance=measured_provenance(
            device,
            backend,
            grid,
            "measured by `blocktune calibrate`; per_block_s is fitted jointly across "
            "block sizes, launch_s and per_token_s per block size",
        ),
        kernel_shape=KVShape(
            num_kv_heads=grid.num_kv_heads, head_dim=grid.head_dim, dtype=grid.dtype
        ),
        memory_bandwidth_bytes_per_s=read,
        compute_flops_per_s=flops,
        copy_bandwidth_bytes_per_s=copy,
        kernel=kernel,
        host_s_per_token=host,
    )
