"""Where a replay's requests come from: a trace file with its loader options, or the embedded day.

`TraceInput` says it the way a sweep spec's ``traces`` entries do (the fields
of `blocktune.traces.load_trace`, or ``path: synthetic`` with the embedded
day's seed, span and rate scale); `TraceInput.load` reads it into the
canonical request table with a label and what the loader warned about.
`embedded_day`, `file_label` and `loader_warnings` are the parts `blocktune
replay` shares with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, model_validator

from blocktune.traces.formats import FORMATS, TIME_UNITS
from blocktune.traces.loaders import LoadedTrace, load_trace
from blocktune.traces.synth import DAY_S, customer_service_day
from blocktune.tuner.config.defaults import DEFAULT_DAY_RATE_SCALE, SYNTHETIC_TRACE

__all__ = [
    "LoadedInput",
    "TraceInput",
    "day_label",
    "embedded_day",
    "file_label",
    "loader_warnings",
]

_LOADER_OPTIONS = ("format", "strict", "rate", "time_col", "time_unit", "prompt_col", "output_col")
_DAY_OPTIONS = ("duration", "rate_scale")


def day_label(seed: int, duration_s: float, rate_scale: float) -> str:
    """How reports name the embedded day with these parameters."""
    return (
        f"synthetic customer-service day (seed {seed}, {duration_s:g} s, rate scale {rate_scale:g})"
    )


def embedded_day(seed: int, duration_s: float, rate_scale: float) -> tuple[pd.DataFrame, str]:
    """The synthetic customer-service day and its label."""
    frame = customer_service_day(seed, duration_s=duration_s, rate_scale=rate_scale)
    return frame, day_label(seed, duration_s, rate_scale)


def file_label(loaded: LoadedTrace) -> str:
    """How reports name a loaded trace file: its name and format."""
    return f"{loaded.path.name} (format {loaded.format})"


def loader_warnings(loaded: LoadedTrace) -> list[str]:
    """What loading noticed, one line each: the rows it skipped by reason, then its warnings."""
    skipped = sum(loaded.skipped.values())
    lines = []
    if skipped:
        reasons = ", ".join(f"{reason} {count}" for reason, count in loaded.skipped.items())
        lines.append(f"skipped {skipped} of {loaded.rows_read} rows: {reasons}")
    return lines + list(loaded.warnings)


@dataclass(frozen=True)
class LoadedInput:
    """A loaded `TraceInput`: the canonical request table, its label and the loader's warnings."""

    frame: pd.DataFrame
    label: str
    warnings: list[str]


class TraceInput(BaseModel):
    """A trace file with the options of `load_trace` (unset: the loader's defaults), or, with
    ``path: synthetic``, the embedded customer-service day. Options that do not apply to the
    kind of trace are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(min_length=1, description=f"a trace file, or {SYNTHETIC_TRACE!r}")
    format: Literal[FORMATS] | None = None
    strict: bool | None = None
    rate: float | None = Field(default=None, gt=0, description="requests/s of generated arrivals")
    seed: int = Field(default=0, description="seed of the embedded day or of rate arrivals")
    time_col: str | None = None
    time_unit: Literal[tuple(TIME_UNITS)] | None = None
    prompt_col: str | None = None
    output_col: str | None = None
    duration: float = Field(default=DAY_S, gt=0, description="embedded day: seconds it spans")
    rate_scale: float = Field(
        default=DEFAULT_DAY_RATE_SCALE, gt=0, description="embedded day: arrival rate multiplier"
    )

    @property
    def embedded(self) -> bool:
        return self.path == SYNTHETIC_TRACE

    @model_validator(mode="after")
    def _options_apply(self) -> TraceInput:
        foreign = _LOADER_OPTIONS if self.embedded else _DAY_OPTIONS
        given = [name for name in foreign if name in self.model_fields_set]
        if given:
            kind = (
                "trace files" if self.embedded else f"path {SYNTHETIC_TRACE!r} (the embedded day)"
            )
            raise ValueError(f"{', '.join(given)}: only for {kind}")
        return self

    def load(self) -> LoadedInput:
        """Read the trace (raises `TraceError` or `WorkloadError`)."""
        if self.embedded:
            return LoadedInput(*embedded_day(self.seed, self.duration, self.rate_scale), [])
        given = {name: getattr(self, name) for name in _LOADER_OPTIONS[1:]}
        loaded = load_trace(
            self.path,
            self.format or "auto",
            seed=self.seed,
            **{name: value for name, value in given.items() if value is not None},
        )
        return LoadedInput(loaded.frame, file_label(loaded), loader_warnings(loaded))
