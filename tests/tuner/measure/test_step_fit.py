"""Fitting the simulator's step form to timed steps: one set of shared terms across block sizes,
per-size terms only where the data shows them, standard errors, the total kept, the spread."""

from dataclasses import replace

import numpy as np
import pytest

from blocktune.tuner.config.calibration import (
    B_INDEPENDENT,
    EngineCalibration,
    StepCoefficients,
    analytic_calibration,
)
from blocktune.tuner.config.policy import ModelShape
from blocktune.tuner.measure.engine_measure import describe_fit
from blocktune.tuner.measure.step_fit import (
    BOOTSTRAP_FITS,
    SPREAD_QUANTILES,
    TimedStep,
    fit_steps,
    predict_step_s,
)

SHARED = dict(
    fixed_s=6e-4, per_token_s=1.5e-7, per_sequence_s=1e-5, prefill_s_per_token=8e-6,
    per_padded_token_s=4e-8, prefill_s_per_pair=2e-9, per_admission_s=3e-4,
)  # fmt: skip
TRUE = {
    8: StepCoefficients(per_block_s=2e-6, **SHARED),
    64: StepCoefficients(per_block_s=0.0, **SHARED),
}
SHORTEST = 37
ANALYTIC = analytic_calibration()
MODEL = ModelShape(
    name="tiny", num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4,
    num_kv_heads=2, head_dim=16, vocab_size=256, dtype="float32",
)  # fmt: skip


def _grid(block_size, coefficients, noise=0.0, seed=0, skew=False):
    """Decode batches at one context and half at the shortest, with admissions of 0, 1 and 4
    prompts of 64, 2 of 200 or 1 of 512 tokens."""
    rng = np.random.default_rng(seed)
    steps = []
    for batch in (1, 8, 32):
        for context in (SHORTEST, 300, 1000, 2000):
            mixes = [(0, batch)] + ([(batch // 2, batch - batch // 2)] if batch > 1 else [])
            for short, long in mixes:
                for prompts, prefill in ((0, 0), (1, 64), (4, 64), (2, 200), (1, 512)):
                    tokens = short * SHORTEST + long * context + prompts * prefill
                    blocks = (
                        short * -(-SHORTEST // block_size)
                        + long * -(-context // block_size)
                        + prompts * -(-prefill // block_size)
                    )
                    step = TimedStep(
                        block_size,
                        batch + prompts,
                        tokens,
                        blocks,
                        prompts * prefill,
                        1.0,
                        padded_tokens=batch * context,
                        prefill_pairs=prompts * prefill**2,
                        prompt_chunks=prompts,
                    )
                    factor = (
                        np.exp(noise * rng.standard_normal())
                        if skew
                        else 1 + noise * (rng.standard_normal())
                    )
                    seconds = predict_step_s(coefficients, step) * factor
                    steps.append(
                        TimedStep(**{**step.__dict__, "seconds": seconds})  # same features
                    )
    return steps


def test_exact_timings_give_back_the_coefficients_with_no_residual():
    fit = fit_steps([s for b, c in TRUE.items() for s in _grid(b, c)])
    assert sorted(fit.coefficients) == [8, 64]
    for block_size, truth in TRUE.items():
        fitted = fit.coefficients[block_size]
        for name, value in truth:
            assert getattr(fitted, name) == pytest.approx(value, rel=1e-6, abs=1e-12), name
        assert fit.residuals[block_size].points == 100
        assert fit.residuals[block_size].max_relative < 1e-9
    assert fit.depends_on_block_size  # 2 us a block at B=8, exactly measured
    assert fit.spread == pytest.approx([1.0] * len(fit.spread))


def test_the_shared_terms_are_one_value_for_every_block_size():
    fit = fit_steps([s for b, c in TRUE.items() for s in _grid(b, c, noise=0.03, seed=b)])
    for name in SHARED:
        assert getattr(fit.coefficients[8], name) == getattr(fit.coefficients[64], name), name
        assert getattr(fit.standard_errors[8], name) == getattr(fit.standard_errors[64], name)


def test_with_no_block_size_effect_the_fit_says_so_and_prices_every_size_alike():
    flat = StepCoefficients(per_block_s=0.0, **SHARED)
    fit = fit_steps([s for b in (8, 16, 64) for s in _grid(b, flat, noise=0.05, seed=b)])
    assert not fit.depends_on_block_size
    assert fit.coefficients[8] == fit.coefficients[16] == fit.coefficients[64]
    assert fit.coefficients[8].per_block_s == 0.0
    assert fit.coefficients[8].fixed_s == pytest.approx(SHARED["fixed_s"], rel=0.15)
    assert fit.coefficients[8].per_admission_s == pytest.approx(SHARED["per_admission_s"], rel=0.3)


def test_noisy_timings_have_standard_errors_that_cover_the_truth():
    fit = fit_steps([s for b, c in TRUE.items() for s in _grid(b, c, noise=0.03, seed=1)])
    fitted, errors = fit.coefficients[8], fit.standard_errors[8]
    for name in ("fixed_s", "prefill_s_per_token", "per_admission_s"):
        assert getattr(errors, name) > 0, name
        assert abs(getattr(fitted, name) - SHARED[name]) < 4 * getattr(errors, name), name
    assert 0.01 < fit.residuals[8].rms_relative < 0.06
    assert fit.residuals[8].max_relative >= fit.residuals[8].rms_relative


def test_skewed_steps_take_their_fitted_time_on_average_and_record_their_spread():
    steps = [
        s
        for seed in (2, 3, 4)  # 120 decode steps, whose measured / fitted the spread is
        for b, c in TRUE.items()
        for s in _grid(b, c, noise=0.4, seed=seed, skew=True)
    ]
    fit = fit_steps(steps)
    ratios = [s.seconds / predict_step_s(fit.coefficients[s.block_size], s) for s in steps]
    assert np.mean(ratios) == pytest.approx(1.0, rel=1e-9)
    spread = np.array(fit.spread)
    assert np.all(np.diff(spread) >= 0) and spread[0] > 0
    assert spread[0] < 0.6 and spread[-1] > 1.8  # lognormal factors of sigma 0.4
    assert spread.mean() == pytest.approx(1.0)
    # One step 30 times slower than its fit moves no quantile far.
    outlier = TimedStep(**{**steps[0].__dict__, "seconds": 30 * steps[0].seconds})
    assert max(fit_steps([*steps, outlier]).spread) < 1.2 * spread[-1]


def test_the_spread_is_the_decode_steps_and_leaves_the_prompt_steps_misfit_out():
    """Decode steps 10% noisy, steps with prompt work 50% (a step at a token count new to
    the process costs more by an amount that varies with the shape: the form's misfit,
    not the machine's noise): the spread the simulator draws factors from is the
    quantiles of the decode steps' measured / fitted, far narrower than all steps'."""
    rng = np.random.default_rng(3)
    steps = []
    for seed in (0, 1, 2):
        for b, c in TRUE.items():
            for s in _grid(b, c, seed=seed):
                sigma = 0.5 if s.prefill_tokens else 0.1
                steps.append(replace(s, seconds=s.seconds * np.exp(sigma * rng.standard_normal())))
    fit = fit_steps(steps)
    ratio = {s: s.seconds / predict_step_s(fit.coefficients[s.block_size], s) for s in steps}
    decodes = [ratio[s] for s in steps if not s.prefill_tokens]
    midpoints = (np.arange(SPREAD_QUANTILES) + 0.5) / SPREAD_QUANTILES
    expected = np.quantile(decodes, midpoints)
    assert fit.spread == pytest.approx(tuple(expected / expected.mean()), rel=1e-9)
    every = np.quantile(list(ratio.values()), midpoints)
    assert every[-1] / every.mean() > 1.5 * fit.spread[-1]


def _moments(steps, size, noise, seed):
    """`steps` in moments of `size` consecutive steps, each moment's times scaled by one
    factor of its own (the machine's speed then): lognormal of sigma `noise`."""
    rng = np.random.default_rng(seed)
    factors = np.exp(noise * rng.standard_normal(len(steps) // size + 1))
    return [
        TimedStep(**{**s.__dict__, "seconds": s.seconds * factors[i // size], "moment": i // size})
        for i, s in enumerate(steps)
    ]


def test_steps_timed_in_one_moment_count_as_one_measurement_in_the_standard_errors():
    """Moments of 10 steps sharing a 10% speed factor, 30 draws: the errors with the moments
    known are about twice those that take every step for its own measurement, fixed_s lies
    within two of them of the truth as often as it should (95%), where the naive ones cover
    it two times in three, and the step time is never found to depend on B, where the naive
    errors find it so now and then; the refits on resampled moments spread as far."""
    flat = StepCoefficients(per_block_s=0.0, **SHARED)
    steps = [s for b in (8, 64) for s in _grid(b, flat)]
    covered = {"moments": 0, "naive": 0}
    naive_dependence = 0
    for seed in range(30):
        in_moments = _moments(steps, 10, 0.1, seed=seed)
        fit = fit_steps(in_moments)
        alone = fit_steps([TimedStep(**{**s.__dict__, "moment": None}) for s in in_moments])
        assert not fit.depends_on_block_size
        naive_dependence += alone.depends_on_block_size
        error, naive = fit.standard_errors[8].fixed_s, alone.standard_errors[8].fixed_s
        assert 1.5 * naive < error < 3 * naive
        miss = abs(fit.coefficients[8].fixed_s - SHARED["fixed_s"])
        covered["moments"] += miss < 2 * error
        covered["naive"] += miss < 2 * naive
        refits = np.array([r[8].fixed_s for r in fit.replicates])
        assert len(refits) == BOOTSTRAP_FITS and np.all(refits >= 0)
        assert 0.7 * error < refits.std() < 1.4 * error
    assert covered["moments"] >= 26 and covered["naive"] <= 22  # 28 and 19 of 30
    assert naive_dependence >= 3  # 6 of 30
    assert fit_steps(in_moments).replicates == fit.replicates  # seeded
    assert fit_steps(in_moments, seed=1).replicates != fit.replicates


def _points_at_every_size(truths, noise, seed):
    """The grid's steps timed point by point at every size in one moment (as `GridTimer`
    does): each point's steps share a lognormal speed factor of sigma `noise`."""
    rng = np.random.default_rng(seed)
    grids = {b: _grid(b, truth) for b, truth in truths.items()}
    steps = []
    for point in range(len(grids[8])):
        factor = np.exp(noise * rng.standard_normal())
        for grid in grids.values():
            step = grid[point]
            steps.append(
                TimedStep(**{**step.__dict__, "seconds": step.seconds * factor, "moment": point})
            )
    return steps


def test_a_size_whose_steps_all_take_longer_gets_a_scale_of_its_own():
    """B=8's steps 5% slower at every point, under a 20% speed swing between points: the
    paired comparison within each point finds it (the form's per-block term cannot: the
    extra time is not per block); with no such difference no size gets a scale."""
    flat = StepCoefficients(per_block_s=0.0, **SHARED)
    slower = StepCoefficients(**{t: 1.05 * v for t, v in flat})
    fit = fit_steps(_points_at_every_size({8: slower, 64: flat}, 0.2, seed=4))
    assert fit.depends_on_block_size
    assert fit.size_scales[8] / fit.size_scales[64] == pytest.approx(1.05, rel=0.005)
    decode = _grid(8, flat)[0]
    at = {b: predict_step_s(fit.coefficients[b], replace(decode, block_size=b)) for b in (8, 64)}
    assert at[8] / at[64] == pytest.approx(1.05, rel=0.005)
    section = fit.engine_calibration(ANALYTIC.provenance, MODEL, threads=1)
    assert section.size_scales == fit.size_scales
    assert "scaled beyond 2 standard errors: 1.0" in section.block_size_verdict()
    lines = describe_fit(section)
    assert f"scale {fit.size_scales[8]:.3f}" in lines[0]
    unscaled = fit.coefficients[8].fixed_s / fit.size_scales[8]
    assert f"shared terms (before each size's scale): fixed_s {unscaled:.3g}" in lines[2]
    same = fit_steps(_points_at_every_size({8: flat, 64: flat}, 0.2, seed=4))
    assert same.size_scales is None and not same.depends_on_block_size
    assert same.coefficients[8] == same.coefficients[64]


def _prefill(prompt, factor, coefficients):
    """One prompt of `prompt` tokens admitted alone, taking `factor` times what the form gives."""
    step = TimedStep(8, 1, prompt, prompt // 8, prompt, 1.0, prefill_pairs=prompt**2)
    step = TimedStep(**{**step.__dict__, "prompt_chunks": 1})
    return TimedStep(**{**step.__dict__, "seconds": factor * predict_step_s(coefficients, step)})


def test_a_few_long_steps_the_form_misprices_do_not_raise_the_price_of_the_short_ones():
    """Prefills of 4000 tokens taking three times what the form gives, where those of 2000
    take what it gives (memory effects a quadratic lacks): the short steps keep their price,
    where scaling to keep the total time would have raised every step's by a third."""
    flat = StepCoefficients(per_block_s=0.0, **SHARED)
    steps = [s for b in (8, 64) for s in _grid(b, flat)]
    rows = [*steps, *[_prefill(2000, 1, flat)] * 10, *[_prefill(4000, 3, flat)] * 10]
    fit = fit_steps(rows)
    decode = steps[0]  # one request at the shortest context, nothing admitted
    assert decode.prefill_tokens == 0 and decode.sequences == 1
    assert predict_step_s(fit.coefficients[8], decode) == pytest.approx(decode.seconds, rel=0.06)
    fitted_total = sum(predict_step_s(fit.coefficients[s.block_size], s) for s in rows)
    assert sum(s.seconds for s in rows) / fitted_total > 1.25


def test_a_calibration_states_whether_the_step_time_depends_on_b():
    flat = StepCoefficients(per_block_s=0.0, **SHARED)
    for truth, verdict in ((flat, B_INDEPENDENT), (TRUE, "the step time depends on B")):
        sizes = {b: truth if isinstance(truth, StepCoefficients) else truth[b] for b in (8, 64)}
        fit = fit_steps([s for b, c in sizes.items() for s in _grid(b, c, noise=0.02, seed=b)])
        section = fit.engine_calibration(ANALYTIC.provenance, MODEL, threads=1)
        assert section.block_size_verdict().startswith(verdict)
    with pytest.raises(ValueError, match="step_spread must be"):
        EngineCalibration(**{**dict(section), "step_spread": (1.2, 0.8)})


def test_a_step_without_time_is_refused():
    with pytest.raises(ValueError, match="positive time"):
        fit_steps([TimedStep(16, 1, 10, 1, 0, 0.0)])
