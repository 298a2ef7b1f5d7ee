"""Values as strict JSON types: numpy scalars as Python numbers, NaN and infinities as null."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["to_jsonable"]


def to_jsonable(value: object) -> object:
    """`value` with numpy scalars as Python numbers and NaN/inf as None, recursively."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    return value
