"""Fitting the simulator's step form to timed steps recovers the coefficients that made them."""

import numpy as np
import pytest

from blocktune.tuner.config.calibration import StepCoefficients
from blocktune.tuner.measure.step_fit import TimedStep, fit_steps, predict_step_s

TRUE = {
    8: StepCoefficients(
        fixed_s=6e-4, per_block_s=2e-6, per_token_s=1.5e-7, per_sequence_s=1e-5,
        prefill_s_per_token=8e-6, per_padded_token_s=4e-8, prefill_s_per_pair=2e-9,
    ),
    64: StepCoefficients(
        fixed_s=5e-4, per_block_s=0.0, per_token_s=3e-7, per_sequence_s=2e-5,
        prefill_s_per_token=1.2e-5, per_padded_token_s=0.0, prefill_s_per_pair=5e-9,
    ),
}  # fmt: skip
SHORTEST = 37


def _grid(block_size, coefficients, noise=0.0, seed=0):
    """Decode batches at one context and half at the shortest, with prefills of 0-512."""
    rng = np.random.default_rng(seed)
    steps = []
    for batch in (1, 8, 32):
        for context in (SHORTEST, 300, 1000, 2000):
            mixes = [(0, batch)] + ([(batch // 2, batch - batch // 2)] if batch > 1 else [])
            for short, long in mixes:
                for prefill in (0, 64, 512):
                    sequences = batch + (prefill > 0)
                    tokens = short * SHORTEST + long * context + prefill
                    blocks = (
                        short * -(-SHORTEST // block_size)
                        + long * -(-context // block_size)
                        + -(-prefill // block_size)
                    )
                    features = dict(padded_tokens=batch * context, prefill_pairs=prefill**2)
                    step = TimedStep(
                        block_size, sequences, tokens, blocks, prefill, 1.0, **features
                    )
                    seconds = predict_step_s(coefficients, step)
                    seconds *= 1 + noise * rng.standard_normal()
                    steps.append(
                        TimedStep(
                            block_size, sequences, tokens, blocks, prefill, seconds, **features
                        )
                    )
    return steps


def test_exact_timings_give_back_the_coefficients_with_no_residual():
    steps = [s for b, c in TRUE.items() for s in _grid(b, c)]
    coefficients, residuals = fit_steps(steps)
    assert sorted(coefficients) == [8, 64]
    for block_size, truth in TRUE.items():
        fitted = coefficients[block_size]
        for name, value in truth:
            assert getattr(fitted, name) == pytest.approx(value, rel=1e-6, abs=1e-12), name
        assert residuals[block_size].points == 60
        assert residuals[block_size].max_relative < 1e-9


def test_noisy_timings_stay_close_and_report_their_residuals():
    # Within one block size blocks are almost proportional to tokens: only the sum
    # per_token + per_block / B (the cost of a context token) is identifiable.
    def context_cost(c, block_size=8):
        return c.per_token_s + c.per_block_s / block_size

    for seed in range(3):
        coefficients, residuals = fit_steps(_grid(8, TRUE[8], noise=0.03, seed=seed))
        fitted, truth = coefficients[8], TRUE[8]
        assert fitted.fixed_s == pytest.approx(truth.fixed_s, rel=0.1)
        assert fitted.prefill_s_per_token == pytest.approx(truth.prefill_s_per_token, rel=0.1)
        assert context_cost(fitted) == pytest.approx(context_cost(truth), rel=0.1)
        assert 0.01 < residuals[8].rms_relative < 0.06
        assert residuals[8].max_relative >= residuals[8].rms_relative


def test_a_step_without_time_is_refused():
    with pytest.raises(ValueError, match="positive time"):
        fit_steps([TimedStep(16, 1, 10, 1, 0, 0.0)])
