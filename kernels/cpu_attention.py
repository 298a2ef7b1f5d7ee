"""Decode attention on the CPU that reads the paged KV cache in place: the "cpu" backend.

The torch backend gathers every decode sequence's blocks into a padded buffer and runs
torch's fused attention over it, once per chunk of sequences; at one query row per
sequence that costs more than the attention itself. This backend calls a small C kernel
(`paged_decode.c`, beside this module) that walks each sequence's block table and reads
K and V where they lie: no copy, no padding, one call per layer. It is compiled on first
use with the machine's C compiler (`$CC`, else `cc`; optimised for this CPU, with OpenMP
where the compiler has it) into a per-user cache, and loaded with ctypes.

`cpu_kernel_error()` says why the kernel is unavailable (no compiler, a failed build),
`None` where it loads; `default_backend(device)` picks "triton" on CUDA, "cpu" where the
kernel loads and "torch" otherwise. Float32 and bfloat16 caches are read natively;
float16 ones go through the torch backend.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

__all__ = [
    "CPU_DTYPES",
    "cpu_kernel_error",
    "default_backend",
    "kernel_cache_dir",
    "paged_attention_cpu",
]

SOURCE = Path(__file__).with_name("paged_decode.c")
CPU_DTYPES = (torch.float32, torch.bfloat16)  # caches the kernel reads in place
OPTIMISE = ("-O3", "-march=native", "-shared", "-fPIC")
OPENMP = "-fopenmp"
BUILD_TIMEOUT_S = 120

_P = ctypes.c_void_p
_I = ctypes.c_int
_SIGNATURE = (_P, _P, _P, _I, _P, _I, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float, _I, _P)


def kernel_cache_dir() -> Path:
    """Where compiled kernels are kept: `$BLOCKTUNE_CACHE`, else `$XDG_CACHE_HOME/blocktune`,
    else `~/.cache/blocktune`."""
    if os.environ.get("BLOCKTUNE_CACHE"):
        return Path(os.environ["BLOCKTUNE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "blocktune"


def _compiler() -> list[str] | None:
    command = shlex.split(os.environ.get("CC", "") or "cc")
    return command if command and shutil.which(command[0]) else None


def _cpu_signature() -> str:
    """The CPU model and feature flags: a kernel built for one CPU is not loaded on another."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    wanted = ("model name", "flags")
    return "\n".join(next((line for line in lines if line.startswith(key)), "") for key in wanted)


def _build(compiler: list[str], target: Path, source: Path = SOURCE) -> str | None:
    """Compile the kernel's `source` to `target` (OpenMP, else without); the compiler's
    message on failure."""
    target.parent.mkdir(parents=True, exist_ok=True)
    message = ""
    for flags in ((*OPTIMISE, OPENMP), OPTIMISE):
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            command = [*compiler, *flags, str(source), "-o", str(built), "-lm"]
            try:
                run = subprocess.run(
                    command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
                )
            except (OSError, subprocess.TimeoutExpired) as failure:
                return f"{shlex.join(command)}: {failure}"
            if run.returncode == 0:
                os.replace(built, target)  # atomic: concurrent builds leave one whole file
                return None
            message = f"{shlex.join(command)} failed: {run.stderr.strip()[-400:]}"
    return message


@functools.cache
def _load() -> ctypes.CDLL | str:
    """The loaded kernel library, or why there is none (built once per process)."""
    compiler = _compiler()
    if compiler is None:
        return "no C compiler found ($CC or cc)"
    version = subprocess.run(
        [*compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout
    key = hashlib.sha256(
        "\n".join((SOURCE.read_text(), shlex.join(compiler), version, _cpu_signature())).encode()
    ).hexdigest()[:16]
    target = kernel_cache_dir() / f"paged_decode-{key}.so"
    if not target.exists():
        try:
            failure = _build(compiler, target)
        except OSError as error:
            failure = f"cannot write {target.parent}: {error}"
        if failure:
            return failure
    return _open(target)


def _open(path: Path) -> ctypes.CDLL:
    """A built kernel library, its entry point typed for ctypes."""
    library = ctypes.CDLL(str(path))
    library.paged_decode.argtypes = _SIGNATURE
    library.paged_decode.restype = ctypes.c_int
    return library


def cpu_kernel_error() -> str | None:
    """Why the "cpu" backend's kernel cannot be used here, or None where it loads."""
    loaded = _load()
    return loaded if isinstance(loaded, str) else None


def default_backend(device: torch.device | str) -> str:
    """The fastest attention backend for `device`: "triton" on CUDA, "cpu" on a CPU where
    the C kernel builds, else "torch"."""
    if torch.device(device).type == "cuda":
        return "triton"
    return "cpu" if cpu_kernel_error() is None else "torch"


def paged_attention_cpu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    block_size: int,
    scale: float | None = None,
    table_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of `query [rows, num_heads, head_dim]` over one layer's paged cache, read
    in place by the C kernel; returns `[rows, num_heads, head_dim]` in `query.dtype`.

    Row `i` attends the first `context_lens[i]` tokens of block-table row `table_rows[i]`
    (int32; row `i` where None): a decode token its whole context; the tokens of a prefill
    chunk, each up to itself, can share their sequence's row (with `block_size` 1 the
    table rows are slot lists). Inputs are CPU tensors the caller has checked (shapes,
    dtypes in `CPU_DTYPES`, contiguous caches, lengths within the table and the pool).
    """
    loaded = _load()
    if isinstance(loaded, str):
        raise RuntimeError(f"the cpu attention kernel is unavailable: {loaded}")
    num_rows, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    grouped = query.float().contiguous()  # [rows, H, D] = [rows, KVH, group, D]
    out = torch.empty_like(grouped)
    table = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    lens = context_lens.contiguous()
    rows = None if table_rows is None else table_rows.contiguous()
    status = loaded.paged_decode(
        grouped.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        int(key_cache.dtype == torch.bfloat16),
        table.data_ptr(),
        table.stride(0),
        None if rows is None else rows.data_ptr(),
        lens.data_ptr(),
        num_rows,
        num_kv_heads,
        num_heads // num_kv_heads,
        head_dim,
        block_size,
        scale,
        torch.get_num_threads(),
        out.data_ptr(),
    )
    if status:
        raise MemoryError("the cpu attention kernel could not allocate its score buffer")
    return out.to(query.dtype)
