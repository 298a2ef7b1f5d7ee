"""A sweep spec: traces x policies x a grid of settings, validated like a policy.

Example::

    traces:                       # trace files or globs with their loader options, or the day
      - {path: logs/day*.csv, format: azure}
      - {path: synthetic, seed: 1, rate_scale: 0.2}
      - {path: logs/month.parquet, shards: 8}      # replayed in 8 time shards
    policies: [customer_service_llama8b, my_policy.yaml]    # files or bundled names
    grid:                         # every combination is one setting
      kv_budget: [2GiB, 3.5GiB, 8GiB]
      interval: [1m, 5m]
      calibration: [default, h100.yaml]

A trace entry takes the fields of `TraceInput` and `shards` (time shards with
a warm-up, `blocktune.tuner.replay.shards`). The grid's keys are the policy
settings a replay depends on (`GRID_KEYS`: all but `NOT_IN_REPLAYS`), each
with a list of values written as in a policy; a section (``model``,
``window``, ``slo``) replaces the policy's whole section. Without a grid,
each policy is replayed as written. Relative paths (traces, policy files,
calibrations in the grid) start at the spec file's folder. Every problem is
reported with its file, line and key path, a grid setting that makes a policy
invalid (a budget that holds no block of the largest candidate) too.

`load_sweep(path)` validates the file and returns its `SweepPoint`s: every
trace file x policy x setting.
"""

from __future__ import annotations

import glob
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    ValidationInfo,
    WrapValidator,
    create_model,
    field_validator,
)

from blocktune.tuner.config.calibration import Calibration, calibration_for
from blocktune.tuner.config.config_files import (
    ConfigError,
    error_message,
    format_location,
    load_yaml_model,
)
from blocktune.tuner.config.defaults import SYNTHETIC_TRACE
from blocktune.tuner.config.policy import Policy, load_policy, policy_path
from blocktune.tuner.replay.inputs import TraceInput, day_label

__all__ = [
    "GRID_KEYS",
    "NOT_IN_REPLAYS",
    "Grid",
    "Setting",
    "SweepPoint",
    "SweepSpec",
    "SweepTrace",
    "load_sweep",
]

NOT_IN_REPLAYS = ("deployment", "mode", "sources", "server", "auth", "actuator")
"""The policy fields a replay does not read: the name and the sidecar's sections."""

GRID_KEYS = tuple(name for name in Policy.model_fields if name not in NOT_IN_REPLAYS)
"""The policy settings a grid may vary: every one a replay depends on."""

AS_WRITTEN = "as written"
"""The name of the one setting of an empty grid: the policy unchanged."""


@dataclass(frozen=True)
class Written:
    """A grid value as the spec wrote it (`text`, for the setting's name) and as validated."""

    text: str
    value: Any


def _written(value: Any, handler: Any) -> Written:
    if isinstance(value, dict | list):
        text = yaml.safe_dump(value, default_flow_style=True, width=1000).strip()
    else:
        text = str(value)
    return Written(text, handler(value))


def _grid_model() -> type[BaseModel]:
    """The grid: for each of `GRID_KEYS`, a list of values of that policy field's type."""
    fields: dict[str, Any] = {}
    for key in GRID_KEYS:
        info = Policy.model_fields[key]
        value = Annotated[(info.annotation, *info.metadata, WrapValidator(_written))]
        fields[key] = (list[value] | None, Field(default=None, min_length=1))
    return create_model(
        "Grid",
        __config__=ConfigDict(extra="forbid", frozen=True),
        __doc__="Per policy setting, the values a sweep tries (see GRID_KEYS).",
        **fields,
    )


Grid = _grid_model()


@dataclass(frozen=True)
class Setting:
    """One combination of grid values, named ``kv_budget=96MiB, interval=1m``."""

    name: str
    values: dict[str, Written]

    def apply(self, policy: Policy) -> Policy:
        """`policy` with this setting's values (raises `ValidationError`)."""
        changed = {key: written.value for key, written in self.values.items()}
        return Policy.model_validate({**policy.model_dump(), **changed})


def settings(grid: BaseModel) -> list[Setting]:
    """Every combination of the grid's values, in `GRID_KEYS` order (just `AS_WRITTEN` when
    the grid is empty)."""
    keys = [key for key in GRID_KEYS if getattr(grid, key) is not None]
    combinations = itertools.product(*(getattr(grid, key) for key in keys))
    found = []
    for values in combinations:
        name = ", ".join(f"{key}={w.text}" for key, w in zip(keys, values, strict=True))
        found.append(Setting(name or AS_WRITTEN, dict(zip(keys, values, strict=True))))
    return found


class SweepTrace(TraceInput):
    """A trace entry: a `TraceInput` whose path may be a glob, and its number of time shards."""

    shards: int = Field(default=1, ge=1, description="time shards, each replayed after a warm-up")

    @field_validator("path")
    @classmethod
    def _matches(cls, path: str, info: ValidationInfo) -> str:
        folder = (info.context or {}).get("folder")
        if folder is not None and path != SYNTHETIC_TRACE and not _matches(folder, path):
            raise ValueError(f"no trace file matches {path!r} (relative to {folder})")
        return path

    def sources(self, folder: Path) -> list[tuple[str, TraceInput]]:
        """Each trace this entry names, as (name, the `TraceInput` that loads it)."""
        options = self.model_dump(exclude={"shards", "path"}, exclude_unset=True)
        if self.embedded:
            name = day_label(self.seed, self.duration, self.rate_scale)
            return [(name, TraceInput(path=self.path, **options))]
        return [
            (match, TraceInput(path=str(folder / match), **options))
            for match in _matches(folder, self.path)
        ]


def _matches(folder: Path, pattern: str) -> list[str]:
    """The files `pattern` names, relative to `folder` when it is relative, sorted."""
    found = glob.glob(str(Path(pattern).expanduser()), root_dir=folder)
    return sorted(match for match in found if (folder / match).is_file())


@dataclass(frozen=True)
class SweepPolicy:
    """A policy of a sweep: as the spec names it, its file, and the policy."""

    name: str
    path: Path
    policy: Policy


def _sweep_policy(value: Any, info: ValidationInfo) -> SweepPolicy:
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected a policy file or a bundled policy's name, got {value!r}")
    folder = (info.context or {}).get("folder", Path.cwd())
    local = folder / Path(value).expanduser()
    try:
        path = local if local.is_file() else policy_path(value)
        return SweepPolicy(value, path, load_policy(path))
    except ConfigError as exc:
        raise ValueError("; ".join(exc.problems)) from None


class SweepSpec(BaseModel):
    """A sweep spec file (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    traces: list[SweepTrace] = Field(min_length=1)
    policies: list[Annotated[SweepPolicy, PlainValidator(_sweep_policy)]] = Field(min_length=1)
    grid: Grid = Grid()

    @field_validator("grid")
    @classmethod
    def _settings_apply(cls, grid: BaseModel, info: ValidationInfo) -> BaseModel:
        problems = []
        for entry in info.data.get("policies", ()):
            for setting in settings(grid):
                try:
                    setting.apply(entry.policy)
                except ValidationError as exc:
                    reasons = "; ".join(
                        f"{format_location(e['loc'])}: {error_message(e)}"
                        if e["loc"]
                        else error_message(e)
                        for e in exc.errors()
                    )
                    problems.append(f"{setting.name} makes policy {entry.name} invalid: {reasons}")
        if problems:
            raise ValueError("\n".join(problems))
        return grid


@dataclass(frozen=True)
class SweepPoint:
    """One replay of a sweep: a trace, a policy with one setting of the grid applied, and
    the calibration that prices it."""

    trace: str
    source: TraceInput
    shards: int
    policy_name: str
    setting: str
    policy: Policy
    calibration: Calibration


def load_sweep(path: Path | str) -> list[SweepPoint]:
    """The points of the sweep spec at `path`; raises `ConfigError` (or `CalibrationError`
    for a calibration file that cannot be used)."""
    path = Path(path)
    folder = path.resolve().parent
    spec = load_yaml_model(path, SweepSpec, context={"folder": folder})
    traces = [
        (name, source, entry.shards)
        for entry in spec.traces
        for name, source in entry.sources(folder)
    ]
    points = []
    for (name, source, shards), named, setting in itertools.product(
        traces, spec.policies, settings(spec.grid)
    ):
        policy = setting.apply(named.policy)
        base = folder if "calibration" in setting.values else named.path.parent
        calibration = calibration_for(policy, base)
        points.append(
            SweepPoint(name, source, shards, named.name, setting.name, policy, calibration)
        )
    return points
