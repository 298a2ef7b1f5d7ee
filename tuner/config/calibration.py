"""Calibration: what the hardware charges for each block size, with where the numbers come from.

A calibration YAML holds, per block size B,

- ``kernel[B]``: the paged decode attention time of one layer for one sequence,
  ``launch_s + per_block_s * ceil(ctx / B) + per_token_s * ctx`` (launch_s is
  per layer per step, shared by the batch), fitted over a grid of context
  lengths and batch sizes for the K/V shape in ``kernel_shape``;
- ``host_s_per_token[B]``: BlockManager bookkeeping per generated token;

and, for the device, ``memory_bandwidth_bytes_per_s`` (reading weights),
``compute_flops_per_s`` (prefill) and ``copy_bandwidth_bytes_per_s`` (bytes a
block copy moves per second, for swap costs). ``provenance`` says where the
numbers come from: a measurement (device, torch and triton versions, date,
grid) or an analytic model with its sources cited.

An optional ``engine`` section (`blocktune calibrate --engine`) holds whole
engine steps of one model timed on the device and fitted per block size B to
the simulator's step form (`STEP_FORM`), with the model's shape, its own
provenance and the fit's residuals. Where it is present the simulator prices
steps with it instead of deriving them from the kernel coefficients.

`default_calibration()` prefers the newest measured file bundled in
``tuner/config/data`` and falls back to the analytic model there.
"""

from __future__ import annotations

from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from blocktune.tuner.config.config_files import ConfigError, load_yaml_model
from blocktune.tuner.config.policy import KVShape, ModelShape, Policy
from blocktune.tuner.config.vllm_backends import device_kind

__all__ = [
    "ANALYTIC_FILE",
    "STEP_FORM",
    "Calibration",
    "CalibrationError",
    "EngineCalibration",
    "FitResiduals",
    "StepCoefficients",
    "B_INDEPENDENT",
    "PER_SIZE_TERMS",
    "SIGNIFICANCE_SE",
    "calibration_for",
    "KernelCoefficients",
    "Provenance",
    "analytic_calibration",
    "bundled_files",
    "bundled_names",
    "default_calibration",
    "device_mismatch",
    "load_calibration",
    "prefill_pairs",
]

ANALYTIC_FILE = "analytic_default.yaml"
SIGNIFICANCE_SE = 2.0
"""A per-size step term counts as non-zero beyond this many standard errors."""
STEP_FORM = (
    "step_s = fixed_s + per_block_s * sum_j ceil(ctx_j / B) + per_token_s * sum_j ctx_j "
    "+ per_padded_token_s * n * max_j ctx_j + per_sequence_s * n "
    "+ prefill_s_per_token * prefill_tokens + prefill_s_per_pair * prefill_pairs "
    "+ per_admission_s * prompt_chunks + per_new_count_s * new_count"
)
"""The engine step time at block size B: n requests in the step, ctx_j the tokens whose K/V
request j holds, prefill_tokens the prompt tokens the step computes, prefill_pairs their
attention pairs (per prompt chunk, its tokens times its prompt's tokens up to the chunk's
end) and prompt_chunks how many prompts it computes a chunk of (each admitted request, when
prompts prefill whole). `n * max ctx` is the batch padded to its longest context, as a decode
attention that gathers the batch into one padded tensor reads it. `new_count` is 1 for a step
that computes a number of tokens (decodes and prompt tokens together) its process has not
computed before: the CPU's kernels are prepared and cached per shape, so such a step costs
more than one that repeats a count. Only `per_block_s` is
fitted per block size (`PER_SIZE_TERMS`); the other terms are fitted once for all sizes."""

PER_SIZE_TERMS = ("per_block_s",)
"""The `StepCoefficients` fields an engine calibration fits per block size: the terms whose
work depends on B. The rest are one value for every size."""

B_INDEPENDENT = "the step time does not depend on B at this grid"
"""What a calibration says when every per-size term is within its errors of 0."""


def prefill_pairs(before: int, computed: int) -> int:
    """Attention pairs of computing `computed` prompt tokens after `before` are in place
    (`STEP_FORM`): the chunk's queries against its prompt's keys up to the chunk's end (the
    engine's causal attention computes the rectangle and masks it)."""
    return computed * (before + computed)


class CalibrationError(ValueError):
    """A calibration that cannot serve a request (for example an uncovered block size)."""


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Provenance(_Frozen):
    """Where the numbers come from: a measurement or an analytic model with cited sources."""

    kind: Literal["measured", "analytic"]
    device: str = Field(min_length=1)
    date: datetime
    torch: str | None = None
    triton: str | None = None
    backend: str | None = None
    grid: dict[str, list[int] | int | str] | None = None
    sources: tuple[str, ...] = ()
    notes: str = ""

    @field_validator("date")
    @classmethod
    def _utc(cls, value: datetime) -> datetime:
        """Dates without a zone are UTC, so any two calibrations can be compared."""
        return value if value.tzinfo else value.replace(tzinfo=timezone.utc)

    @model_validator(mode="after")
    def _documented(self) -> Provenance:
        if self.kind == "measured" and (self.torch is None or self.grid is None):
            raise ValueError("a measured calibration must record its torch version and grid")
        if self.kind == "analytic" and not self.sources:
            raise ValueError("an analytic calibration must cite its sources")
        return self


class KernelCoefficients(_Frozen):
    """Decode attention time of one layer: per launch, per block and per context token."""

    launch_s: float = Field(ge=0)
    per_block_s: float = Field(ge=0)
    per_token_s: float = Field(ge=0)


class StepCoefficients(_Frozen):
    """One engine step's time at one block size, the terms of `STEP_FORM` [s]. The padded,
    pair, admission and new-count terms are 0 in calibrations written before they were
    fitted."""

    fixed_s: float = Field(ge=0)
    per_block_s: float = Field(ge=0)
    per_token_s: float = Field(ge=0)
    per_sequence_s: float = Field(ge=0)
    prefill_s_per_token: float = Field(ge=0)
    per_padded_token_s: float = Field(default=0.0, ge=0)
    prefill_s_per_pair: float = Field(default=0.0, ge=0)
    per_admission_s: float = Field(default=0.0, ge=0)
    per_new_count_s: float = Field(default=0.0, ge=0)

    def scaled(self, factor: float) -> StepCoefficients:
        """Every term multiplied by `factor`: every step `factor` times as long."""
        return self.model_copy(
            update={name: getattr(self, name) * factor for name in type(self).model_fields}
        )


class FitResiduals(_Frozen):
    """How well `STEP_FORM` fits the timed steps of one block size: relative residuals
    (predicted / measured - 1) over `points` grid points."""

    points: int = Field(gt=0)
    rms_relative: float = Field(ge=0)
    max_relative: float = Field(ge=0)


class EngineCalibration(_Frozen):
    """Engine steps of one model timed on a device and fitted to `STEP_FORM`: the terms of
    `PER_SIZE_TERMS` per block size, the others once across all sizes.

    `standard_errors` holds each coefficient's standard error (same layout as `steps`);
    `size_scales` holds, per block size, the time of its steps over the form's with the
    shared terms, from the grid's points timed at every size in one moment, where some size
    is beyond `SIGNIFICANCE_SE` standard errors of 1 (its `steps` are then scaled by it);
    `depends_on_block_size` is False when every per-size term was within
    `SIGNIFICANCE_SE` standard errors of 0 and no size had a scale of its own, and the
    per-size terms are then 0 (the shared terms refitted without them), so every size costs
    the same time; `step_spread` holds
    quantiles of measured / fitted over the timed decode steps at the midpoints of
    equal-probability bins, scaled to mean 1, of which the simulator draws the steps'
    factors (each held for a stretch of simulated time). The three
    are absent in calibrations written before joint fits."""

    provenance: Provenance
    model: ModelShape
    threads: int = Field(gt=0, description="torch intra-op threads the steps were timed with")
    clock: Literal["wall", "cpu"] = Field(
        default="wall", description="wall time, or the timing thread's CPU time (one thread)"
    )
    steps: dict[int, StepCoefficients] = Field(min_length=1)
    residuals: dict[int, FitResiduals] = Field(min_length=1)
    standard_errors: dict[int, StepCoefficients] | None = None
    depends_on_block_size: bool | None = None
    step_spread: tuple[float, ...] = ()
    size_scales: dict[int, float] | None = None

    @model_validator(mode="after")
    def _model_named_with_its_vocabulary(self) -> EngineCalibration:
        if self.model.name is None or self.model.vocab_size is None:
            raise ValueError("model: the timed model's name and vocab_size are needed")
        return self

    @model_validator(mode="after")
    def _residuals_per_block_size(self) -> EngineCalibration:
        covered = [("residuals", self.residuals)]
        if self.standard_errors is not None:
            covered.append(("standard_errors", self.standard_errors))
        if self.size_scales is not None:
            covered.append(("size_scales", self.size_scales))
        for name, section in covered:
            if set(self.steps) != set(section):
                raise ValueError(
                    f"steps cover block sizes {sorted(self.steps)} but {name} covers "
                    f"{sorted(section)}; both must list the same ones"
                )
        if self.step_spread and (
            len(self.step_spread) < 2
            or min(self.step_spread) <= 0
            or list(self.step_spread) != sorted(self.step_spread)
        ):
            raise ValueError(
                "step_spread must be at least two positive quantiles in increasing order"
            )
        return self

    def block_size_verdict(self) -> str:
        """Whether the step time depends on B at the calibration's grid, in words."""
        if self.depends_on_block_size is None:
            return "fitted per block size (a calibration before joint fits)"
        if not self.depends_on_block_size:
            return B_INDEPENDENT
        beyond = f"beyond {SIGNIFICANCE_SE:g} standard errors"
        reasons = []
        if any(getattr(c, t) > 0 for c in self.steps.values() for t in PER_SIZE_TERMS):
            reasons.append(f"{', '.join(PER_SIZE_TERMS)} {beyond}")
        if self.size_scales is not None:
            scales = ", ".join(f"{s:.3f}x at B={b}" for b, s in sorted(self.size_scales.items()))
            reasons.append(f"each size's steps scaled {beyond}: {scales}")
        return f"the step time depends on B ({'; '.join(reasons)})"

    def require_model(self, shape: ModelShape) -> None:
        """Raise `CalibrationError` unless `shape` is the model these steps were timed on."""
        differences = [
            f"{name} {getattr(shape, name)} (measured: {getattr(self.model, name)})"
            for name in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "dtype")
            if getattr(shape, name) != getattr(self.model, name)
        ]
        if differences:
            raise CalibrationError(
                f"the engine calibration was measured with {self.model.name}, but the "
                f"policy's model differs: {', '.join(differences)}"
            )


class Calibration(_Frozen):
    """Measured or analytic costs per block size, with provenance."""

    provenance: Provenance
    kernel_shape: KVShape
    memory_bandwidth_bytes_per_s: float = Field(gt=0)
    compute_flops_per_s: float = Field(gt=0)
    copy_bandwidth_bytes_per_s: float = Field(gt=0)
    kernel: dict[int, KernelCoefficients] = Field(min_length=1)
    host_s_per_token: dict[int, float] = Field(min_length=1)
    engine: EngineCalibration | None = None

    @model_validator(mode="after")
    def _same_block_sizes(self) -> Calibration:
        if set(self.kernel) != set(self.host_s_per_token):
            raise ValueError(
                f"kernel covers block sizes {sorted(self.kernel)} but host_s_per_token covers "
                f"{sorted(self.host_s_per_token)}; both must list the same ones"
            )
        if self.engine is not None and not set(self.engine.steps) <= set(self.kernel):
            raise ValueError(
                f"engine.steps covers block sizes {sorted(self.engine.steps)}, not all among "
                f"the kernel's {sorted(self.kernel)}"
            )
        if min(self.host_s_per_token.values()) < 0:
            raise ValueError("host_s_per_token values must be >= 0")
        return self

    @property
    def block_sizes(self) -> tuple[int, ...]:
        """The block sizes every section covers (the engine steps too, where measured)."""
        sizes = set(self.kernel) if self.engine is None else set(self.engine.steps)
        return tuple(sorted(sizes))

    def require(self, block_sizes: tuple[int, ...] | list[int]) -> None:
        """Raise `CalibrationError` unless every block size in `block_sizes` is calibrated."""
        missing = sorted(set(block_sizes) - set(self.block_sizes))
        if missing:
            raise CalibrationError(
                f"calibration for {self.provenance.device} ({self.provenance.kind}) has no "
                f"costs for block sizes {missing}; it covers {list(self.block_sizes)}"
            )

    def kernel_for(self, block_size: int, kv_bytes_per_token_layer: int) -> KernelCoefficients:
        """Coefficients for `block_size`, scaled to a model whose K+V per token and layer
        take `kv_bytes_per_token_layer` bytes (decode attention is bandwidth-bound, so the
        per-block and per-token times scale with the bytes read)."""
        self.require([block_size])
        scale = kv_bytes_per_token_layer / self.kernel_shape.kv_bytes_per_token_layer
        c = self.kernel[block_size]
        return KernelCoefficients(
            launch_s=c.launch_s,
            per_block_s=c.per_block_s * scale,
            per_token_s=c.per_token_s * scale,
        )

    def with_engine(self, engine: EngineCalibration) -> Calibration:
        """This calibration with `engine` as its engine section (validated)."""
        return Calibration.model_validate({**dict(self), "engine": engine})

    def to_yaml(self) -> str:
        """The calibration as YAML that `load_calibration` reads back unchanged."""
        data = self.model_dump(mode="json", exclude_none=True)
        sections = [(data, "kernel"), (data, "host_s_per_token")]
        if "engine" in data:
            sections += [
                (data["engine"], key)
                for key in ("steps", "residuals", "standard_errors", "size_scales")
                if key in data["engine"]
            ]
        for parent, key in sections:
            parent[key] = {int(b): value for b, value in parent[key].items()}
        return yaml.safe_dump(data, sort_keys=False)

    def describe(self) -> str:
        """One line: device, kind and date, and the engine steps' model where measured."""
        p = self.provenance
        text = f"{p.kind} calibration, {p.device}, {p.date:%Y-%m-%d}"
        if self.engine is not None:
            text += f", engine steps measured with {self.engine.model.name}"
        return text


def load_calibration(path: Path | str) -> Calibration:
    """Read and validate a calibration YAML file; `ConfigError` lists every problem."""
    return load_yaml_model(path, Calibration)


def _data_folder() -> Path:
    return Path(str(resources.files("blocktune.tuner.config") / "data"))


def bundled_files(folder: Path | None = None) -> list[Path]:
    """The calibration YAML files in `folder` (default: the package's ``data`` folder)."""
    folder = _data_folder() if folder is None else folder
    return sorted(folder.glob("*.yaml"))


def analytic_calibration() -> Calibration:
    """The bundled analytic model (cited constants), whatever else is bundled."""
    return load_calibration(_data_folder() / ANALYTIC_FILE)


def default_calibration(folder: Path | None = None) -> Calibration:
    """The newest measured calibration in `folder` (default: the package's ``data``
    folder), else the analytic model there."""
    folder = _data_folder() if folder is None else folder
    measured = []
    for path in bundled_files(folder):
        calibration = load_calibration(path)
        if calibration.provenance.kind == "measured":
            measured.append(calibration)
    if measured:
        return max(measured, key=lambda c: c.provenance.date)
    analytic = folder / ANALYTIC_FILE
    if not analytic.is_file():
        raise ConfigError(analytic, [f"{analytic}: no measured calibration and no analytic model"])
    return load_calibration(analytic)


def bundled_names() -> dict[str, Path]:
    """The bundled calibrations by name (their file names without ``.yaml``)."""
    return {path.stem: path for path in bundled_files()}


def calibration_for(policy: Policy, policy_dir: Path) -> Calibration:
    """The calibration a policy names: a file (relative to the policy's folder), else a
    bundled calibration of that name, or the bundled default."""
    path = policy.calibration_path(policy_dir)
    if path is None:
        return default_calibration()
    if not path.exists():
        path = bundled_names().get(policy.calibration, path)
    return load_calibration(path)


def device_mismatch(
    policy: Policy, calibration: Calibration, engine_device: str | None = None
) -> str | None:
    """A warning when the calibration prices another device than the deployment's, else None.

    The deployment's device is the policy's `device` (names compared without case, spaces
    or punctuation) and the engine's: `engine_device` as the running engine reports it
    (vLLM's platform, e.g. 'cpu'), else, for `engine: vllm`, the kind of device its
    attention backend runs on. The engine's is checked whether or not the policy names a
    device; without a name only CPU against GPU is told apart.
    """
    priced = calibration.provenance.device
    if policy.device is not None and _letters(policy.device) not in _letters(priced):
        runs_on = policy.device
    elif engine_device is not None and device_kind(engine_device) != device_kind(priced):
        runs_on = f"{engine_device} (as the engine reports)"
    elif (
        engine_device is None
        and policy.engine == "vllm"
        and policy.backend.device != device_kind(priced)
    ):
        runs_on = f"a {policy.backend.device.upper()} (vLLM's {policy.vllm_backend} backend)"
    else:
        return None
    names = ", ".join(sorted(bundled_names()))
    return (
        f"the policy runs on {runs_on} but its calibration is for {priced}: every "
        "prediction prices the other device; name a calibration for it with the policy key "
        f"'calibration' (bundled: {names}) or measure one with `blocktune calibrate`"
    )


def _letters(text: str) -> str:
    return "".join(ch for ch in text.lower() if ch.isalnum())
