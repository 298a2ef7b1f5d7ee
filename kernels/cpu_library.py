"""The C library of the CPU kernels: compiled on first use, loaded with ctypes.

`paged_decode.c` (attention over the paged cache, `blocktune.kernels.cpu_attention`) and
`layer_ops.c` (a layer's fused small operators, `blocktune.kernels.cpu_layer_ops`), with
the helpers both include (`cpu_math.h`), are compiled together with the machine's C
compiler (`$CC`, else `cc`; optimised for this CPU, with OpenMP where the compiler has it)
into a per-user cache, once per source, compiler and CPU, and loaded once per process.
A cached library that does not load (empty, or cut short by a crash) is rebuilt once;
a library is written whole to disk (fsync) before it is renamed into the cache.
`cpu_library()` is the loaded library, or a string saying why there is none (logged once
per process: the torch operators serve instead); `cpu_kernel_error()` just that reason
(None where it loads).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["SOURCES", "cpu_kernel_error", "cpu_library", "kernel_cache_dir"]

HERE = Path(__file__).parent
SOURCES = (HERE / "paged_decode.c", HERE / "layer_ops.c")
HEADERS = (HERE / "cpu_math.h",)
# No FMA contraction: the fused layer operators round as torch's operators do (layer_ops.c).
OPTIMISE = ("-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC")
OPENMP = "-fopenmp"
BUILD_TIMEOUT_S = 120
log = logging.getLogger("blocktune.kernels")

_P = ctypes.c_void_p
_I = ctypes.c_int
_I64 = ctypes.c_int64
_F = ctypes.c_float
SIGNATURES = {
    "paged_decode": (_P, _I64, _P, _P, _I, _P, _I, _P, _P, _I, _I, _I, _I, _I, _F, _I, _P, _I64),
    "add_rms_norm": (_P, _P, _P, _P, _I, _I, _F, _I),
    "rotate": (_P, _I64, _I, _I, _I, _P, _P, _I),
    "silu_and_mul": (_P, _P, _I, _I, _I),
    "write_slots": (_P, _I64, _P, _I64, _P, _P, _P, _I, _I64),
    "argmax_rows": (_P, _I64, _I, _I, _P),
}
"""Each entry point's ctypes argument types (all return int or nothing)."""


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


def build(compiler: list[str], target: Path, sources: tuple[Path, ...] = SOURCES) -> str | None:
    """Compile `sources` into the library `target` (OpenMP, else without); the compiler's
    message on failure. Headers are found beside the first source."""
    target.parent.mkdir(parents=True, exist_ok=True)
    message = ""
    for flags in ((*OPTIMISE, OPENMP), OPTIMISE):
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            command = [*compiler, *flags, f"-I{sources[0].parent}", *map(str, sources)]
            command += ["-o", str(built), "-lm"]
            try:
                run = subprocess.run(
                    command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
                )
            except (OSError, subprocess.TimeoutExpired) as failure:
                return f"{shlex.join(command)}: {failure}"
            if run.returncode == 0:
                with built.open("rb") as written:
                    os.fsync(written.fileno())  # whole on disk before the rename publishes it
                os.replace(built, target)  # atomic: concurrent builds leave one whole file
                return None
            message = f"{shlex.join(command)} failed: {run.stderr.strip()[-400:]}"
    return message


def open_library(path: Path) -> ctypes.CDLL:
    """A built library, its entry points typed for ctypes."""
    library = ctypes.CDLL(str(path))
    for name, argtypes in SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes = argtypes
        function.restype = ctypes.c_int if name == "paged_decode" else None
    return library


def library_path(compiler: list[str]) -> Path:
    """Where the library built by `compiler` from the current sources for this CPU is
    cached."""
    version = subprocess.run(
        [*compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout
    texts = [path.read_text() for path in (*SOURCES, *HEADERS)]
    key = hashlib.sha256(
        "\n".join((*texts, shlex.join((*compiler, *OPTIMISE)), version, _cpu_signature())).encode()
    ).hexdigest()[:16]
    return kernel_cache_dir() / f"cpu_kernels-{key}.so"


@functools.cache
def cpu_library() -> ctypes.CDLL | str:
    """The loaded kernel library, or why there is none (built once per process; a cached
    one that does not load is rebuilt once)."""
    compiler = _compiler()
    if compiler is None:
        return _unavailable("no C compiler found ($CC or cc)")
    target = library_path(compiler)
    broken = None
    if target.exists():
        try:
            return open_library(target)
        except (OSError, AttributeError) as error:
            broken = f"the cached {target} does not load ({error})"
            log.warning("%s: rebuilding it", broken)
    try:
        failure = build(compiler, target)
    except OSError as error:
        failure = f"cannot write {target.parent}: {error}"
    if failure is None:
        try:
            return open_library(target)
        except (OSError, AttributeError) as error:
            failure = f"the built {target} does not load ({error})"
    return _unavailable(failure if broken is None else f"{broken}; rebuilding it failed: {failure}")


def _unavailable(reason: str) -> str:
    log.warning("the CPU kernels are unavailable, torch's operators serve instead: %s", reason)
    return reason


def cpu_kernel_error() -> str | None:
    """Why the CPU kernels cannot be used here, or None where they load."""
    loaded = cpu_library()
    return loaded if isinstance(loaded, str) else None
