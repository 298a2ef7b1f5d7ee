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

- standard errors: robust to what the steps of one timing moment share
  (`TimedStep.moment`: a grid point's steps at every block size are timed
  within seconds of each other, so the machine's speed then is in all of them):
  the residuals are summed per moment in the sandwich estimate (`_fit`). The
  least squares' own errors, which take every step for a measurement of its
  own, put SmolLM2's fixed_s at 46.9 ± 0.7 ms where two validations of one
  trace fitted 46.9 and 53.6 ms;
- refits: `BOOTSTRAP_FITS` fits of the moments drawn with replacement (each
  bringing all its steps), kept in `StepFit.replicates`: `blocktune validate`
  predicts with some of them too, and the spread of those predictions is the
  calibration's own noise on them (non-negative coefficients, and through the
  simulator, where a standard error is a linear approximation);
- B-independence: when no per-size coefficient exceeds `SIGNIFICANCE_SE`
  standard errors, the shared terms are refitted without the per-size columns
  (which become 0);
- the sizes' scales: a grid point is timed at every block size in one moment,
  so each size's measured / fitted over the point's mean of them is a paired
  measurement of that size's own speed, the machine's divided out. Where some
  size's mean of them is beyond `SIGNIFICANCE_SE` standard errors (over the
  points) and `SIZE_SCALE_TIE` of 1, every size's coefficients are scaled by its own
  (`StepFit.size_scales`, kept in the calibration). tiny-random's decode steps
  at B=8 took longer than at B=16 at 16 of 18 grid points (median 5%), at
  small contexts as at large: not the shape of `per_block_s`, whose
  coefficient stayed within its errors, and the live runs' TPOT p50 at B=8 was
  4% above B=16's. Without either, the step time does not depend on B at this
  grid;
- the mean: relative-error least squares undershoots right-skewed step times,
  so every coefficient is scaled by one factor that makes measured / fitted 1 on
  average over the rows: every step's expected time is its fitted time, short
  or long. (Scaling to keep the rows' total time instead lets the few longest
  steps set the factor for all: a grid whose 4083-token prefills took 1.9 s,
  where the form priced them at 0.9 s, doubled every decode step's price.)
  Every refit is scaled over its own rows alike;
- the spread: `SPREAD_QUANTILES` quantiles of measured / fitted over the
  decode-only rows (all rows where there are none; mean 1,
  `EngineCalibration.step_spread`), of which the simulator draws the factors of
  its steps. The rows with prompt work are left out: their ratios hold the form's
  misfit more than the machine's noise (a step at a new token count costs more
  than one at a count computed before, by an amount that varies from shape to
  shape), and the decode steps, most of a served run's time, are what the
  factors scale. On tiny-random's grid fitted to the Azure lengths, measured /
  fitted spread 0.85-1.25 over its decode steps and 0.73-2.4 over its admission
  steps (1st-99th percentiles); the live run's decode steps spread 0.79-1.32.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from blocktune.tuner.config.calibration import (
    PER_SIZE_TERMS,
    SIGNIFICANCE_SE,
    EngineCalibration,
    FitResiduals,
    Provenance,
    StepCoefficients,
)
from blocktune.tuner.config.policy import ModelShape

__all__ = [
    "BOOTSTRAP_FITS",
    "SIZE_SCALE_TIE",
    "SPREAD_QUANTILES",
    "StepFit",
    "TimedStep",
    "fit_steps",
    "predict_step_s",
]

SPREAD_QUANTILES = 50
"""Quantiles of the step spread a calibration records: the midpoints of equal-probability
bins (1%, 3%, ..., 99%), so a uniform draw among them has the steps' mean and one outlier
moves no quantile far."""
SIZE_SCALE_TIE = 0.01
"""A block size's scale counts only where it is further than this from 1, whatever its error:
exactly timed steps differ by rounding, and 1% moves no ranking (`validation.RANK_TIE`)."""
BOOTSTRAP_FITS = 200
"""Refits on the timing moments drawn with replacement that a fit keeps (module doc)."""

TERMS = tuple(StepCoefficients.model_fields)
SHARED_TERMS = tuple(t for t in TERMS if t not in PER_SIZE_TERMS)


@dataclass(frozen=True)
class TimedStep:
    """One measured engine step: its features at `block_size` and its time [s]. Steps of one
    `moment` were timed together (a grid point's steps at every block size): the standard
    errors and the refits take them as one measurement; None is a moment of its own."""

    block_size: int
    sequences: int
    context_tokens: int
    context_blocks: int
    prefill_tokens: int
    seconds: float
    padded_tokens: int = 0
    prefill_pairs: int = 0
    prompt_chunks: int = 0
    new_count: int = 0
    moment: int | None = None

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
            "per_new_count_s": self.new_count,
        }


@dataclass(frozen=True)
class StepFit:
    """What `fit_steps` found: per block size the coefficients, their standard errors and
    the residuals; whether the step time depends on B; the spread of measured / fitted; the
    `BOOTSTRAP_FITS` refits on resampled moments (per block size their coefficients); and
    the sizes' scales where they differ (None where they do not)."""

    coefficients: dict[int, StepCoefficients]
    standard_errors: dict[int, StepCoefficients]
    residuals: dict[int, FitResiduals]
    depends_on_block_size: bool
    spread: tuple[float, ...]
    replicates: tuple[dict[int, StepCoefficients], ...] = ()
    size_scales: dict[int, float] | None = None

    def engine_calibration(
        self, provenance: Provenance, model: ModelShape, *, threads: int, clock: str = "wall"
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
            size_scales=self.size_scales,
        )


def predict_step_s(coefficients: StepCoefficients, step: TimedStep) -> float:
    """The step time `STEP_FORM` gives for `step`'s features."""
    return float(sum(getattr(coefficients, t) * x for t, x in step.features.items()))


def fit_steps(steps: Iterable[TimedStep], *, seed: int = 0) -> StepFit:
    """The joint fit of the timed steps (see the module doc); `seed` draws the resamples."""
    rows = list(steps)
    for step in rows:
        if not step.seconds > 0:
            raise ValueError(f"a timed step must take a positive time, got {step}")
    if not rows:
        raise ValueError("no timed steps to fit")
    sizes = sorted({r.block_size for r in rows})
    seconds = np.array([r.seconds for r in rows])
    moments = _moments(rows)
    columns = _columns(sizes, per_size=True)
    design = _design(rows, columns)
    values, errors = _fit(design, seconds, moments)
    depends = any(
        value > SIGNIFICANCE_SE * error
        for (term, _), value, error in zip(columns, values, errors, strict=True)
        if term in PER_SIZE_TERMS
    )
    if not depends:
        columns = _columns(sizes, per_size=False)
        design = _design(rows, columns)
        values, errors = _fit(design, seconds, moments)
    rng = np.random.default_rng(seed)
    refits = []
    for _ in range(BOOTSTRAP_FITS):
        drawn = np.concatenate([moments[k] for k in rng.integers(0, len(moments), len(moments))])
        refits.append(_fit(design[drawn], seconds[drawn])[0])
    ratio = seconds / (design @ values)
    sizes_of_rows = np.array([r.block_size for r in rows])
    scales = _size_scales(ratio, sizes_of_rows, moments)
    if scales is not None:
        depends = True
        ratio = ratio / np.array([scales[b] for b in sizes_of_rows])
        kept = float(np.mean(ratio))  # measured / fitted stays 1 on average
        scales = {b: scale * kept for b, scale in scales.items()}
        ratio /= kept
    residuals = {}
    for b in sizes:
        relative = 1 / ratio[[r.block_size == b for r in rows]] - 1
        residuals[b] = FitResiduals(
            points=len(relative),
            rms_relative=float(np.sqrt(np.mean(relative**2))),
            max_relative=float(np.abs(relative).max()),
        )
    decodes = np.array([r.prefill_tokens == 0 for r in rows])
    basis = ratio[decodes] if decodes.any() else ratio
    spread = np.quantile(basis, (np.arange(SPREAD_QUANTILES) + 0.5) / SPREAD_QUANTILES)
    spread /= spread.mean()  # the quantiles' mean is the ratios' up to binning
    scale = scales or dict.fromkeys(sizes, 1.0)
    return StepFit(
        coefficients={b: _coefficients(columns, values * scale[b], b) for b in sizes},
        standard_errors={b: _coefficients(columns, errors * scale[b], b) for b in sizes},
        residuals=residuals,
        depends_on_block_size=depends,
        spread=tuple(float(q) for q in spread),
        replicates=tuple(
            {b: _coefficients(columns, r * scale[b], b) for b in sizes} for r in refits
        ),
        size_scales=scales,
    )


def _size_scales(
    ratio: np.ndarray, sizes: np.ndarray, moments: list[np.ndarray]
) -> dict[int, float] | None:
    """Each block size's measured / fitted relative to the other sizes' in the same moments,
    where some size is beyond `SIGNIFICANCE_SE` standard errors of 1 (None otherwise). Per
    moment timed at several sizes, each size's mean ratio over the moment's mean of them is
    one paired measurement: the machine's speed in that moment divides out. A scale within
    `SIZE_SCALE_TIE` of 1 does not count."""
    paired: dict[int, list[float]] = {}
    for moment in moments:
        means = {
            int(b): float(np.mean(ratio[moment][sizes[moment] == b])) for b in set(sizes[moment])
        }
        if len(means) < 2:
            continue
        center = float(np.mean(list(means.values())))
        for b, mean in means.items():
            paired.setdefault(b, []).append(mean / center)
    if not paired or any(len(v) < 2 for v in paired.values()):
        return None
    scales = {b: float(np.mean(v)) for b, v in paired.items()}
    errors = {b: float(np.std(v, ddof=1) / np.sqrt(len(v))) for b, v in paired.items()}
    if all(abs(scales[b] - 1) <= max(SIGNIFICANCE_SE * errors[b], SIZE_SCALE_TIE) for b in scales):
        return None
    return dict(sorted(scales.items()))


def _moments(rows: list[TimedStep]) -> list[np.ndarray]:
    """The rows' indices grouped by timing moment (a row without one is a group of its own)."""
    groups: dict[object, list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(("row", i) if row.moment is None else row.moment, []).append(i)
    return [np.array(g) for g in groups.values()]


def _columns(sizes: list[int], *, per_size: bool) -> list[tuple[str, int | None]]:
    """(term, block size) per design column: None for a shared term."""
    columns: list[tuple[str, int | None]] = [(t, None) for t in SHARED_TERMS]
    if per_size:
        columns += [(t, b) for t in PER_SIZE_TERMS for b in sizes]
    return columns


def _design(rows: list[TimedStep], columns: list[tuple[str, int | None]]) -> np.ndarray:
    """Each row's feature per column (a per-size column's is 0 at other block sizes)."""
    return np.array(
        [
            [r.features[t] if b is None or b == r.block_size else 0.0 for t, b in columns]
            for r in rows
        ]
    )


def _fit(
    design: np.ndarray, seconds: np.ndarray, moments: list[np.ndarray] | None = None
) -> tuple[np.ndarray, np.ndarray | None]:
    """The coefficient per column: non-negative least squares of the relative error (columns
    scaled to unit maximum), scaled so that measured / fitted is 1 on average over the rows;
    with `moments`, also each coefficient's standard error, robust to errors shared within a
    moment: the sandwich (X'X)^-1 (sum over moments of X_m' r_m r_m' X_m) (X'X)^-1 of the
    scaled relative design X and residuals r, times m / (m - 1) for m moments."""
    from scipy.optimize import nnls

    relative = design / seconds[:, None]
    scale = np.abs(relative).max(axis=0)
    scale[scale == 0] = 1.0
    scaled = relative / scale
    solution, _ = nnls(scaled, np.ones(len(seconds)))
    fitted = design @ (solution / scale)
    priced = fitted > 0  # a refit on few drawn moments may leave some rows' terms all 0
    factor = float(np.mean(seconds[priced] / fitted[priced])) if priced.any() else 1.0
    if moments is None:
        return solution / scale * factor, None
    residual = scaled @ solution - 1
    bread = np.linalg.pinv(scaled.T @ scaled)
    scores = np.array([scaled[m].T @ residual[m] for m in moments])
    count = len(moments)
    meat = scores.T @ scores * (count / (count - 1) if count > 1 else 1.0)
    covariance = bread @ meat @ bread
    errors = np.sqrt(np.clip(np.diag(covariance), 0, None)) / scale
    return solution / scale * factor, errors * factor


def _coefficients(
    columns: list[tuple[str, int | None]], values: np.ndarray, block_size: int
) -> StepCoefficients:
    """The coefficients at `block_size` from per-column values (absent per-size terms: 0)."""
    by_column = dict(zip(columns, values.tolist(), strict=True))
    return StepCoefficients(
        **{t: by_column.get((t, None), by_column.get((t, block_size), 0.0)) for t in TERMS}
    )
