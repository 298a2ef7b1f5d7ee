"""Fit the simulator's step form (`STEP_FORM`) to timed engine steps, per block size.

Each timed step is one row: the step's features as the simulator counts them
(requests, context tokens and blocks they hold, the batch padded to its longest
context, prompt tokens computed and their attention pairs) and its measured
seconds. Per block size the seven non-negative coefficients minimise
the squared *relative* error (each row divided by its time), so short decode
steps weigh as much as long prefill steps; columns are scaled to unit maximum
first, which keeps the non-negative least squares (`scipy.optimize.nnls`) well
conditioned when token counts are in the thousands and the constant is one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from blocktune.tuner.config.calibration import FitResiduals, StepCoefficients

__all__ = ["TimedStep", "fit_steps", "predict_step_s"]


@dataclass(frozen=True)
class TimedStep:
    """One measured engine step: its features at `block_size` and its wall time [s]."""

    block_size: int
    sequences: int
    context_tokens: int
    context_blocks: int
    prefill_tokens: int
    seconds: float
    padded_tokens: int = 0
    prefill_pairs: int = 0

    @property
    def features(self) -> tuple[float, ...]:
        """The multipliers of `StepCoefficients`' fields, in their order."""
        return (
            1.0,
            self.context_blocks,
            self.context_tokens,
            self.sequences,
            self.prefill_tokens,
            self.padded_tokens,
            self.prefill_pairs,
        )


def predict_step_s(coefficients: StepCoefficients, step: TimedStep) -> float:
    """The step time `STEP_FORM` gives for `step`'s features."""
    terms = [getattr(coefficients, name) for name in StepCoefficients.model_fields]
    return float(np.dot(terms, step.features))


def fit_steps(
    steps: Iterable[TimedStep],
) -> tuple[dict[int, StepCoefficients], dict[int, FitResiduals]]:
    """Coefficients and residuals per block size from the timed steps (see the module doc)."""
    from scipy.optimize import nnls

    by_size: dict[int, list[TimedStep]] = {}
    for step in steps:
        if not step.seconds > 0:
            raise ValueError(f"a timed step must take a positive time, got {step}")
        by_size.setdefault(step.block_size, []).append(step)
    coefficients, residuals = {}, {}
    for block_size, rows in sorted(by_size.items()):
        seconds = np.array([r.seconds for r in rows])
        design = np.array([r.features for r in rows]) / seconds[:, None]
        scale = design.max(axis=0)
        scale[scale == 0] = 1.0
        solution, _ = nnls(design / scale, np.ones(len(rows)))
        fitted = StepCoefficients(
            **dict(zip(StepCoefficients.model_fields, (solution / scale).tolist(), strict=True))
        )
        relative = np.array([predict_step_s(fitted, r) for r in rows]) / seconds - 1
        coefficients[block_size] = fitted
        residuals[block_size] = FitResiduals(
            points=len(rows),
            rms_relative=float(np.sqrt(np.mean(relative**2))),
            max_relative=float(np.abs(relative).max()),
        )
    return coefficients, residuals
