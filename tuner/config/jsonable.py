"""Standard JSON in and out: values as strict JSON types, and a parser of standard JSON only.

`to_jsonable` turns numpy scalars into Python numbers and NaN/inf into null;
`from_json` reads RFC 8259 JSON and nothing else (the one JSON parser of bodies,
request logs and state files).
"""

from __future__ import annotations

import math

import numpy as np
import pydantic_core

__all__ = ["from_json", "to_jsonable"]


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


def from_json(data: bytes | str) -> object:
    """The value of a JSON text; `ValueError` naming the line and column of the first problem.

    Refused, unlike `json.loads`: NaN and Infinity (not JSON), invalid UTF-8 and lone
    surrogates (not text), and nesting deeper than 200 levels (pydantic-core's limit;
    never a `RecursionError`). A number too large for a float reads as infinity, which
    the models that validate the value refuse.
    """
    return pydantic_core.from_json(data, allow_inf_nan=False)
