"""The YAML policy of one deployment: model shape, KV budget, candidates and timing.

A policy file is read with `yaml.safe_load` and validated as `Policy`: unknown
keys are rejected, every problem is reported together with its file, line and
key path, and the result is frozen. Sizes take units ("40GiB", "512MiB",
"40GB"), durations a number and a unit ("30s", "5m", "1h30m").

Each section is a `Section` (extra keys forbidden, frozen). A later section,
such as the sidecar's sources, server, auth or actuator, is one more optional
`Section` field on `Policy` with a default, so existing files stay valid.

Example::

    deployment: support-bot
    model: {num_layers: 32, num_heads: 32, num_kv_heads: 8, head_dim: 128,
            dtype: bfloat16, num_params: 8.03e9}
    kv_budget: 4GiB
    candidates: [8, 16, 32, 64, 128]
    window: {capacity: 1000, min_samples: 200}
    interval: 5m
    min_dwell: 30m
    safety_factor: 2
    mode: recommend
    calibration: default
"""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ByteSize,
    ConfigDict,
    Field,
    model_validator,
)

from blocktune.tuner.yaml_config import load_yaml_model

__all__ = [
    "DTYPE_BYTES",
    "ModelShape",
    "Policy",
    "Section",
    "WindowSettings",
    "load_policy",
    "parse_duration",
]

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1}
DEFAULT_CANDIDATES = (8, 16, 32, 64, 128)
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(value: object) -> object:
    """'5m', '30s', '1h30m', '250ms' or a number of seconds -> `timedelta`.

    Anything else is passed on unchanged for pydantic to reject.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return timedelta(seconds=value)
    if not isinstance(value, str):
        return value
    text = value.strip().lower()
    parts = list(_DURATION_PART.finditer(text))
    if not parts or "".join(p.group(0) for p in parts).replace(" ", "") != text.replace(" ", ""):
        raise ValueError(
            f"expected a duration such as '30s', '5m', '1h30m' or '250ms', got {value!r}"
        )
    return timedelta(seconds=sum(float(p.group(1)) * _UNIT_SECONDS[p.group(2)] for p in parts))


def _positive_duration(value: timedelta) -> timedelta:
    if value <= timedelta(0):
        raise ValueError(f"must be longer than zero, got {value.total_seconds()} s")
    return value


def _non_negative_duration(value: timedelta) -> timedelta:
    if value < timedelta(0):
        raise ValueError(f"must not be negative, got {value.total_seconds()} s")
    return value


def _power_of_two(value: int) -> int:
    if value <= 0 or value & (value - 1):
        raise ValueError(f"block sizes must be powers of two, got {value}")
    return value


def _distinct_sorted(values: tuple[int, ...]) -> tuple[int, ...]:
    if len(set(values)) != len(values):
        raise ValueError(f"candidates are listed twice: {sorted(values)}")
    return tuple(sorted(values))


Duration = Annotated[timedelta, BeforeValidator(parse_duration), AfterValidator(_positive_duration)]
DwellDuration = Annotated[
    timedelta, BeforeValidator(parse_duration), AfterValidator(_non_negative_duration)
]
BlockSize = Annotated[int, Field(strict=True), AfterValidator(_power_of_two)]


class Section(BaseModel):
    """Base of every policy section: unknown keys are errors and the values are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelShape(Section):
    """The served model: attention shape, KV dtype and weight count."""

    num_layers: int = Field(gt=0)
    num_heads: int = Field(gt=0, description="query heads")
    num_kv_heads: int = Field(gt=0, description="K/V heads (fewer than num_heads with GQA)")
    head_dim: int = Field(gt=0)
    dtype: Literal["float32", "float16", "bfloat16", "float8"]
    num_params: float = Field(gt=0, description="weights, for the per-step weight read time")

    @model_validator(mode="after")
    def _gqa_groups(self) -> ModelShape:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        return self

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def kv_bytes_per_token_layer(self) -> int:
        """Bytes of K and V of one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V of one token across all layers (one KV slot)."""
        return self.num_layers * self.kv_bytes_per_token_layer

    @property
    def weight_bytes(self) -> float:
        return self.num_params * self.dtype_bytes


class WindowSettings(Section):
    """How many finished requests the length window keeps and how many a decision needs."""

    capacity: int = Field(default=1000, gt=0)
    min_samples: int = Field(default=100, gt=0)

    @model_validator(mode="after")
    def _fits(self) -> WindowSettings:
        if self.min_samples > self.capacity:
            raise ValueError(
                f"min_samples ({self.min_samples}) exceeds capacity ({self.capacity}): "
                "the window could never hold enough requests"
            )
        return self


class Policy(Section):
    """One deployment's tuning policy (see the module docstring for the file format)."""

    deployment: str = Field(min_length=1)
    model: ModelShape
    kv_budget: Annotated[ByteSize, Field(gt=0)]
    candidates: Annotated[
        tuple[BlockSize, ...], Field(min_length=1), AfterValidator(_distinct_sorted)
    ] = DEFAULT_CANDIDATES
    window: WindowSettings = WindowSettings()
    interval: Duration = timedelta(minutes=5)
    min_dwell: DwellDuration = timedelta(minutes=30)
    safety_factor: float = Field(default=2.0, ge=1.0)
    mode: Literal["recommend", "enforce"] = "recommend"
    calibration: str = Field(
        default="default", min_length=1, description="'default' or a YAML path"
    )

    @model_validator(mode="after")
    def _budget_holds_a_block(self) -> Policy:
        largest = max(self.candidates) * self.model.kv_bytes_per_token
        if self.kv_budget < largest:
            raise ValueError(
                f"kv_budget ({int(self.kv_budget)} bytes) holds no block of the largest "
                f"candidate ({max(self.candidates)} tokens = {largest} bytes)"
            )
        return self

    def calibration_path(self, base: Path) -> Path | None:
        """The calibration file (relative paths start at `base`), or None for the default."""
        if self.calibration == "default":
            return None
        path = Path(self.calibration).expanduser()
        return path if path.is_absolute() else base / path


def load_policy(path: Path | str) -> Policy:
    """Read and validate a policy file; `ConfigError` lists every problem."""
    return load_yaml_model(path, Policy)
