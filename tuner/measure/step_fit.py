"""Fit the simulator's step form (`STEP_FORM`) to timed engine steps, jointly across block sizes.

Each timed step is one row: the step's features as the simulator counts them
(requests, context tokens and blocks they hold, the batch padded to its longest
context, prompt tokens computed, their attention pairs and the prompts they
belong to) and its measured seconds. The terms of `PER_SIZE_TERMS` get one
column per block size (non-zero only in that size's rows); every other term is
one column for all sizes, so machine drift between sizes cannot pass for a
block-size effect. The non-negative coefficients minimise the squared
*relative* error (each row divided by its time), so short decode steps weigh as
much as long prefill steps; columns are scaled to unit maximum first, which
keeps the non-negative least squares (`scipy.optimize.nnls`) well conditioned.

Then:

- standard errors: from the weighted residual variance and the pseudo-inverse
  of the normal matrix, in the coefficients' units;
- B-independence: when no per-size coefficient exceeds `SIGNIFICANCE_SE`
  standard errors, the step time does not depend on B at this grid, and the
  shared terms are refitted without the per-size columns (which become 0);
- the mean: relative-error least squares undershoots right-skewed step times,
  so every coefficient is scaled by one factor that makes measured / fitted 1 on
  average over the rows: every step's expected time is its fitted time, short
  or long. (Scaling to keep the rows' total time instead lets the few longest
  steps set the factor for all: a grid whose 4083-token prefills took 1.9 s,
  where the form priced them at 0.9 s, doubled every decode step's price.)
- the spread: `SPREAD_QUANTILES` quantiles of measured / fitted over all rows
  (mean 1, `EngineCalibration.step_spread`), of which the simulator draws one
  per step.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from blocktune.tuner.config.calibration import (
    PER_SIZE_TERMS,
    SIGNIFICANCE_SE,
    EngineCalibration,
    EngineModel,
    FitResiduals,
    Provenance,
    StepCoefficients,
)

__all__ = ["SPREAD_QUANTILES", "StepFit", "TimedStep", "fit_steps", "predict_step_s"]

SPREAD_QUANTILES = 50
"""Quantiles of the step spread a calibration records: the midpoints of equal-probability
bins (1%, 3%, ..., 99%), so a uniform draw among them has the steps' mean and one outlier
moves no quantile far."""

TERMS = tuple(StepCoefficients.model_fields)
SHARED_TERMS = tuple(t for t in TERMS if t not in PER_SIZE_TERMS)


@dataclass(frozen=True)
class TimedStep:
    """One measured engine step: its features at `block_size` and its time [s]."""

    block_size: int
    sequences: int
    context_tokens: int
    context_blocks: int
    prefill_tokens: int
    seconds: float
    padded_tokens: int = 0
    prefill_pairs: int = 0
    prompt_chunks: int = 0

    @property
    def features(self) -> dict[str, float]:
        """The multiplier of each `StepCoefficients` field."""
        return {
            "fixed_s": 1.0,
            "per_block_s": self.context_blocks,
            "per_token_s": self.context_tokens,
            "per_sequence_s": self.sequences,
            "prefill_s_per_token": self.prefill_tokens,
            "per_padded_token_s": self.padded_tokens,
            "prefill_s_per_pair": self.prefill_pairs,
            "per_admission_s": self.prompt_chunks,
        }


@dataclass(frozen=True)
class StepFit:
    """What `fit_steps` found: per block size the coefficients, their standard errors and
    the residuals; whether the step time depends on B; the spread of measured / fitted."""

    coefficients: dict[int, StepCoefficients]
    standard_errors: dict[int, StepCoefficients]
    residuals: dict[int, FitResiduals]
    depends_on_block_size: bool
    spread: tuple[float, ...]

    def engine_calibration(
        self, provenance: Provenance, model: EngineModel, *, threads: int, clock: str = "wall"
    ) -> EngineCalibration:
        """The engine section of a calibration holding this fit, for `model` timed with
        `threads` torch threads by `clock`."""
        return EngineCalibration(
            provenance=provenance,
            model=model,
            threads=threads,
            clock=clock,
            steps=self.coefficients,
            residuals=self.residuals,
            standard_errors=self.standard_errors,
            depends_on_block_size=self.depends_on_block_size,
            step_spread=self.spread,
        )


def predict_step_s(coefficients: StepCoefficients, step: TimedStep) -> float:
    """The step time `STEP_FORM` gives for `step`'s features."""
    return float(sum(getattr(coefficients, t) * x for t, x in step.features.items()))


def fit_steps(steps: Iterable[TimedStep]) -> StepFit:
    """The joint fit of the timed steps (see the module doc)."""
    rows = list(steps)
    for step in rows:
        if not step.seconds > 0:
            raise ValueError(f"a timed step must take a positive time, got {step}")
    if not rows:
        raise ValueError("no timed steps to fit")
    sizes = sorted({r.block_size for r in rows})
    columns = _columns(sizes, per_size=True)
    values, errors = _solve(rows, columns)
    depends = any(
        values[c] > SIGNIFICANCE_SE * errors[c] for c in columns if c[0] in PER_SIZE_TERMS
    )
    if not depends:
        columns = _columns(sizes, per_size=False)
        values, errors = _solve(rows, columns)
    coefficients = {b: _coefficients(values, b) for b in sizes}
    measured = np.array([r.seconds for r in rows])
    fitted = np.array([predict_step_s(coefficients[r.block_size], r) for r in rows])
    scale = float(np.mean(measured / fitted))  # measured / fitted is 1 on average
    coefficients = {b: _scaled(c, scale) for b, c in coefficients.items()}
    ratio = measured / (fitted * scale)
    residuals = {}
    for b in sizes:
        relative = 1 / ratio[[r.block_size == b for r in rows]] - 1
        residuals[b] = FitResiduals(
            points=len(relative),
            rms_relative=float(np.sqrt(np.mean(relative**2))),
            max_relative=float(np.abs(relative).max()),
        )
    spread = np.quantile(ratio, (np.arange(SPREAD_QUANTILES) + 0.5) / SPREAD_QUANTILES)
    spread /= spread.mean()  # the quantiles' mean is the ratios' up to binning
    return StepFit(
        coefficients=coefficients,
        standard_errors={b: _scaled(_coefficients(errors, b), scale) for b in sizes},
        residuals=residuals,
        depends_on_block_size=depends,
        spread=tuple(float(q) for q in spread),
    )


def _columns(sizes: list[int], *, per_size: bool) -> list[tuple[str, int | None]]:
    """(term, block size) per design column: None for a shared term."""
    columns: list[tuple[str, int | None]] = [(t, None) for t in SHARED_TERMS]
    if per_size:
        columns += [(t, b) for t in PER_SIZE_TERMS for b in sizes]
    return columns


def _solve(rows: list[TimedStep], columns: list[tuple[str, int | None]]) -> tuple[dict, dict]:
    """Non-negative least squares of the relative error: coefficient and standard error per
    column."""
    from scipy.optimize import nnls

    seconds = np.array([r.seconds for r in rows])
    design = np.array(
        [
            [r.features[t] if b is None or b == r.block_size else 0.0 for t, b in columns]
            for r in rows
        ]
    )
    design /= seconds[:, None]
    scale = np.abs(design).max(axis=0)
    scale[scale == 0] = 1.0
    scaled = design / scale
    solution, _ = nnls(scaled, np.ones(len(rows)))
    residual = scaled @ solution - 1
    dof = max(1, len(rows) - int(np.count_nonzero(solution)))
    variance = float(residual @ residual) / dof
    covariance = variance * np.linalg.pinv(scaled.T @ scaled)
    errors = np.sqrt(np.clip(np.diag(covariance), 0, None)) / scale
    return (
        dict(zip(columns, (solution / scale).tolist(), strict=True)),
        dict(zip(columns, errors.tolist(), strict=True)),
    )


def _coefficients(values: dict, block_size: int) -> StepCoefficients:
    """The coefficients at `block_size` from per-column values (absent per-size terms: 0)."""
    return StepCoefficients(
        **{
            t: values.get((t, None), values.get((t, block_size), 0.0))
            for t in StepCoefficients.model_fields
        }
    )


def _scaled(coefficients: StepCoefficients, factor: float) -> StepCoefficients:
    return StepCoefficients(**{t: v * factor for t, v in coefficients})
