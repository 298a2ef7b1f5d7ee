"""vLLM's attention backends and the block sizes each one accepts.

vLLM fixes its KV block size at start-up (`--block-size`) and checks it against
the attention backend it selected: each backend declares the kernel block sizes
it runs (`get_supported_kernel_block_sizes`, a list of exact sizes and
`MultipleOf(n)` rules), and `select_common_block_size` in
`vllm/v1/worker/utils.py` accepts a block size that some declared size divides
(the block is then split into kernel blocks of that size); any other size fails
after the model loaded ("No common block size for 16"). Every rule below reduces
to "multiples of n", read from vLLM 0.32.0's source file named beside it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "BACKEND_LINE",
    "DEFAULT_VLLM_BACKEND",
    "PLATFORM_LINE",
    "VLLM_BACKENDS",
    "VllmBackend",
    "VllmBackendName",
    "device_kind",
]

DeviceKind = Literal["cpu", "gpu"]

PLATFORM_LINE = re.compile(r"(?:Automatically detected platform |\bdevice_config=)(\w+)")
"""vLLM's platform: logged at start-up, and in the engine's configuration line."""
BACKEND_LINE = re.compile(r"Using (\w+) (?:attention )?backend")
"""The attention backend a vLLM server logs that it selected."""


@dataclass(frozen=True)
class VllmBackend:
    """One vLLM attention backend: its name as vLLM logs it, the block-size rule, the kind
    of device it runs on and the vLLM source the rule comes from."""

    name: str
    multiple: int
    device: DeviceKind
    source: str
    declared: str

    def accepts(self, block_size: int) -> bool:
        """Whether vLLM starts with `--block-size block_size` on this backend."""
        return block_size > 0 and block_size % self.multiple == 0

    def refused(self, block_sizes: tuple[int, ...]) -> list[int]:
        """The sizes among `block_sizes` this backend refuses."""
        return [b for b in block_sizes if not self.accepts(b)]

    def rule(self) -> str:
        """The rule in words, with where it comes from."""
        return (
            f"vLLM's {self.name} backend takes multiples of {self.multiple} "
            f"({self.declared} in {self.source})"
        )


VllmBackendName = Literal[
    "CPU_ATTN",
    "FLASH_ATTN",
    "FLASHINFER",
    "TRITON_ATTN",
    "FLEX_ATTENTION",
    "ROCM_ATTN",
    "ROCM_AITER_FA",
]
"""The backends a policy may name (vLLM's `--attention-backend` names)."""

VLLM_BACKENDS: dict[str, VllmBackend] = {
    backend.name: backend
    for backend in (
        VllmBackend(
            "CPU_ATTN", 32, "cpu", "vllm/v1/attention/backends/cpu_attn.py", "[MultipleOf(32)]"
        ),
        VllmBackend(
            "FLASH_ATTN",
            16,
            "gpu",
            "vllm/v1/attention/backends/flash_attn.py",
            "[MultipleOf(16)] on CUDA",
        ),
        VllmBackend(
            "FLASHINFER",
            16,
            "gpu",
            "vllm/v1/attention/backends/flashinfer.py",
            "[16, 32, 64] kernel pages",
        ),
        VllmBackend(
            "TRITON_ATTN",
            16,
            "gpu",
            "vllm/v1/attention/backends/triton_attn.py",
            "[MultipleOf(16)]",
        ),
        VllmBackend(
            "FLEX_ATTENTION",
            16,
            "gpu",
            "vllm/v1/attention/backends/flex_attention.py",
            "[MultipleOf(16)]",
        ),
        VllmBackend(
            "ROCM_ATTN", 16, "gpu", "vllm/v1/attention/backends/rocm_attn.py", "[MultipleOf(16)]"
        ),
        VllmBackend(
            "ROCM_AITER_FA",
            16,
            "gpu",
            "vllm/v1/attention/backends/rocm_aiter_fa.py",
            "[16, 32] kernel pages",
        ),
    )
}

DEFAULT_VLLM_BACKEND: VllmBackendName = "FLASH_ATTN"
"""vLLM's usual choice on an NVIDIA GPU, assumed when an `engine: vllm` policy names none."""


def device_kind(device: str) -> DeviceKind:
    """'cpu' for a device name with the word CPU in it (a measured CPU calibration's, vLLM's
    platform 'cpu'), else 'gpu'."""
    return "cpu" if "cpu" in device.lower().split() else "gpu"
