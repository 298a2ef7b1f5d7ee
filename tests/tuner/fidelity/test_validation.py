"""The live side of `blocktune validate`: the virtual clock, and the engine against the simulator.

Both sides count a request's blocks alike (`runtime.block_manager.blocks_for`: the K/V of
p + t - 1 tokens in its t-th step), so with equal constant step times they must admit,
preempt and finish the same requests at the same instants. Neither side chunks prefills
here.
"""

import math

import numpy as np
import pandas as pd
import pytest

from blocktune.runtime.config import EngineConfig
from blocktune.runtime.engine import Engine
from blocktune.runtime.loading import load_weights
from blocktune.tuner.config.calibration import analytic_calibration
from blocktune.tuner.config.policy import Policy
from blocktune.tuner.fidelity.live import prompt_ids, serve_live
from blocktune.tuner.fidelity.served_metrics import (
    METRICS,
    compared,
    predict,
    prediction_method,
)
from blocktune.tuner.fidelity.validation import RANK_METRICS, BlockSizeCheck, Validation
from blocktune.tuner.fidelity.validation_report import (
    format_ranking,
    format_validation_table,
    validation_dict,
)
from blocktune.tuner.sim.served import ServedMetrics
from blocktune.tuner.sim.simulator import simulate
from blocktune.tuner.sim.step_cost import StepCostModel
from blocktune.tuner.sim.workload import Workload

STEP_S = 0.25  # exact in binary, so both sides' sums of step times are exact too
SLOT_BYTES = 2 * 2 * 16 * 4 * 2  # tiny-random: layers x K/V heads x head_dim x fp32 x (K, V)


@pytest.fixture(scope="module")
def model():
    return load_weights("tiny-random", seed=0)


def _workload(arrivals, prompts, outputs):
    frame = pd.DataFrame(
        {"arrival_s": arrivals, "prompt_tokens": prompts, "output_tokens": outputs}
    )
    return Workload.from_frame(frame)


def _server(num_blocks, block_size=8):
    policy = Policy(
        deployment="tiny",
        model={"num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
               "dtype": "float32", "num_params": 1e5},
        kv_budget=num_blocks * block_size * SLOT_BYTES,
        candidates=(block_size,),
    )  # fmt: skip
    return StepCostModel(policy, analytic_calibration(), fixed_step_s=STEP_S)


def _engine(model, num_blocks, block_size=8, prefix_caching=False):
    config = EngineConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_seqs=64,
        max_model_len=512,
        candidate_block_sizes=(block_size,),
        enable_prefix_caching=prefix_caching,
    )
    return Engine(model, config)


def test_the_virtual_clock_admits_requests_in_arrival_order(model):
    workload = _workload([0.0, 0.1, 0.6, 5.0], [5, 9, 3, 7], [4, 4, 4, 4])
    live = serve_live(_engine(model, 64), workload, step_s=STEP_S)
    # r0 starts at 0; r1 (0.1) joins at the next step boundary, 0.25; r2 (0.6) at 0.75;
    # the engine idles after r2 finishes at 1.75, and the clock jumps to r3's arrival.
    np.testing.assert_array_equal(live.first_token_s, [0.25, 0.5, 1.0, 5.25])
    np.testing.assert_array_equal(live.finish_s, [1.0, 1.25, 1.75, 6.0])
    assert live.generated.tolist() == [4, 4, 4, 4]
    assert live.steps == 7 + 4 and live.busy_s == 11 * STEP_S
    run = simulate(workload, _server(64), 8)
    np.testing.assert_array_equal(run.first_token_s, live.first_token_s)
    np.testing.assert_array_equal(run.finish_s, live.finish_s)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_engine_and_simulator_admit_and_preempt_alike_at_constant_step_times(model, seed):
    rng = np.random.default_rng(seed)
    count = 24
    arrivals = np.sort(rng.integers(0, 40, count)) * STEP_S / 2
    prompts = rng.integers(2, 40, count)
    outputs = rng.integers(1, 30, count)
    workload = _workload(arrivals, prompts, outputs)
    live = serve_live(_engine(model, 14), workload, step_s=STEP_S, seed=seed)
    run = simulate(workload, _server(14), 8)
    assert live.preemptions == run.preemptions > 0
    np.testing.assert_array_equal(live.first_token_s, run.first_token_s)
    np.testing.assert_array_equal(live.finish_s, run.finish_s)
    assert live.peak_blocks == run.peak_blocks == 14
    assert live.generated.tolist() == outputs.tolist()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_preempted_request_recomputes_only_what_its_cached_blocks_miss_on_both_sides(model, seed):
    """With the prefix cache on, a preempted request's full blocks stay cached until evicted:
    its readmission finds the same leading blocks in the engine and in the simulator."""
    rng = np.random.default_rng(seed)
    count = 16
    arrivals = np.sort(rng.integers(0, 8, count)) * STEP_S
    workload = _workload(arrivals, rng.integers(20, 60, count), rng.integers(10, 40, count))
    live = serve_live(_engine(model, 24, prefix_caching=True), workload, step_s=STEP_S)
    run = simulate(workload, _server(24), 8)
    assert live.preemptions == run.preemptions > 0
    assert live.prefix_hit_tokens == run.prefix_hit_tokens > 0
    np.testing.assert_array_equal(live.finish_s, run.finish_s)


def test_prompts_share_exactly_the_tokens_their_prefix_hashes_cover():
    frame = pd.DataFrame(
        {
            "arrival_s": [0.0, 1.0, 2.0],
            "prompt_tokens": [300, 600, 40],
            "output_tokens": [5, 5, 5],
            "prefix_hashes": [[11, 12], [11, 12, 13], [11]],
        }
    )
    workload = Workload.from_frame(frame)
    a, b, c = (prompt_ids(workload, row, 256, seed=3) for row in range(3))
    assert [len(a), len(b), len(c)] == [300, 600, 40]
    assert a == b[:300] and a[:40] == c  # the hashes cover all of a and c
    assert b[300:512] != prompt_ids(workload, 1, 256, seed=4)[300:512]
    assert prompt_ids(workload, 1, 256, seed=3) == b


def _metrics(tokens_per_s, tpot_p50_s=0.01, ttft_p99_s=0.2):
    return ServedMetrics(
        tokens_per_s=tokens_per_s,
        ttft_p50_s=0.1,
        ttft_p99_s=ttft_p99_s,
        tpot_p50_s=tpot_p50_s,
        tpot_p99_s=0.02,
        e2e_p99_s=0.5,
        peak_kv_bytes=10 * 2**20,
        peak_kv_blocks=10.0,
        preemptions=0.0,
    )


def _check(size, predicted, *runs):
    return BlockSizeCheck(size, _metrics(*predicted), tuple(_metrics(*r) for r in runs))


def test_the_json_of_a_check_holds_the_compared_metrics_of_each_side():
    """A served run's record holds more (e2e p99, peak KV bytes) than the check compares;
    the JSON's predicted, measured and per-run objects hold exactly `METRICS`."""
    check = _check(8, (99,), (100, 0.01), (102, 0.03))
    result = validation_dict(Validation(trace={}, setup={}, checks=[check]))["results"][0]
    assert tuple(result["predicted"]) == tuple(result["measured"]) == METRICS
    assert result["predicted"] == compared(_metrics(99))
    assert result["measured"]["tokens_per_s"] == 101.0
    assert result["measured"]["tpot_p50_s"] == pytest.approx(0.02)
    assert [run["tokens_per_s"] for run in result["measured_runs"]] == [100, 102]
    assert check.measured.peak_kv_bytes == 10 * 2**20  # the mean keeps every field


def test_rankings_compare_only_block_sizes_apart_beyond_the_run_to_run_noise():
    # Runs of 8 and 16 spread by up to 2 tok/s: 8 vs 16 (1 apart) is a tie, 32 stands out.
    checks = [
        _check(8, (99,), (100,), (102,)),
        _check(16, (100,), (102,), (102,)),
        _check(32, (120,), (110,), (111,)),
    ]
    validation = Validation(trace={}, setup={}, checks=checks)
    # Squares about each size's mean: 1 + 1, 0, 0.25 + 0.25 over 3 degrees of freedom.
    deviation, freedom = validation.noise("tokens_per_s")
    assert (deviation, freedom) == (pytest.approx((2.5 / 3) ** 0.5), 3)
    pairs = validation.compared_pairs("tokens_per_s")
    assert [(a.block_size, b.block_size) for a, b in pairs] == [(8, 32), (16, 32)]
    ranking = validation.rank("tokens_per_s")
    assert ranking.predicted == ranking.measured == [32, 16, 8]
    assert (ranking.compared, ranking.agreeing, ranking.agreement) == (2, 2, True)
    assert checks[0].error("tokens_per_s") == pytest.approx(99 / 101 - 1)
    assert checks[0].noise("tokens_per_s") == pytest.approx(2 / 101)
    swapped = Validation(
        trace={}, setup={}, checks=[_check(8, (130,), (100,), (102,)), *checks[1:]]
    )
    assert (swapped.rank("tokens_per_s").agreeing, swapped.rank("tokens_per_s").agreement) == (
        1,
        False,
    )
    # Runs that repeat exactly (no noise) and sizes 0.01% apart: ties, nothing compared, and
    # no agreement is claimed.
    exact = [_check(8, (76.61,), (76.60,), (76.60,)), _check(16, (76.60,), (76.61,), (76.61,))]
    flat = Validation(trace={}, setup={}, checks=exact).rank("tokens_per_s")
    assert (flat.compared, flat.agreement) == (0, None)
    line = format_ranking(flat)
    assert "no pair compared" in line and "alike" not in line


def test_a_pair_is_apart_only_beyond_students_t_on_the_pooled_run_to_run_deviation():
    # Means 101 and 104, 3 apart, beyond the widest spread of a size's runs (2), but the
    # pooled deviation is sqrt(4 / 3) with 3 degrees of freedom: the difference must exceed
    # t(0.975, 3) = 3.182 times 1.155 = 3.67.
    checks = [
        _check(8, (100,), (100,), (102,)),
        _check(16, (100,), (103,), (105,)),
        _check(64, (100,), (100,), (100,)),
    ]
    validation = Validation(trace={}, setup={}, checks=checks)
    assert not validation.apart("tokens_per_s", checks[0], checks[1])
    assert validation.apart("tokens_per_s", checks[1], checks[2])  # 4 apart
    assert validation.rank("tokens_per_s").compared == 1
    # Three runs a size narrow the standard error: the same means 3 apart now differ.
    three = [
        _check(8, (100,), (100,), (102,), (101,)),
        _check(16, (100,), (103,), (105,), (104,)),
    ]
    assert Validation(trace={}, setup={}, checks=three).apart("tokens_per_s", *three)
    # One run a size measures no noise: any pair beyond `RANK_TIE` is apart.
    single = [_check(8, (100,), (100,)), _check(16, (100,), (100.5,))]
    assert Validation(trace={}, setup={}, checks=single).noise("tokens_per_s") == (0.0, 0)
    assert not Validation(trace={}, setup={}, checks=single).apart("tokens_per_s", *single)
    single[1] = _check(16, (100,), (102,))
    assert Validation(trace={}, setup={}, checks=single).apart("tokens_per_s", *single)


def test_a_predicted_tie_shows_as_one_and_does_not_order_a_pair_alike():
    checks = [
        _check(8, (100, 0.01), (100, 0.010), (100, 0.010)),
        _check(16, (100, 0.01), (100, 0.010), (100, 0.010)),
        _check(64, (100, 0.01), (100, 0.013), (100, 0.013)),
    ]
    tpot = Validation(trace={}, setup={}, checks=checks).rank("tpot_p50_s")
    assert (tpot.predicted_text, tpot.measured_text) == ("8=16=64", "8=16 64")
    assert (tpot.compared, tpot.agreeing, tpot.agreement) == (2, 0, False)
    assert tpot.predicted_ties == 2
    line = format_ranking(tpot)
    assert "predicted 8=16=64, measured 8=16 64: 0 of 2 pair(s)" in line
    assert "(2 of them predicted equal: the calibration prices those sizes alike" in line
    assert (
        validation_dict(Validation(trace={}, setup={}, checks=checks))["rankings"]["tpot_p50_s"][
            "predicted_ties"
        ]
        == 2
    )


def test_each_ranking_metric_counts_its_own_pairs():
    # tokens/s ties everywhere; TPOT p50 sets 8 apart (and the prediction agrees); TTFT p99
    # sets 64 apart and the prediction orders it the other way.
    checks = [
        _check(8, (100, 0.020, 0.30), (100, 0.021, 0.30), (100, 0.021, 0.30)),
        _check(16, (100, 0.010, 0.20), (100, 0.010, 0.30), (100, 0.010, 0.30)),
        _check(64, (100, 0.010, 0.10), (100, 0.010, 0.60), (100, 0.010, 0.60)),
    ]
    validation = Validation(trace={}, setup={}, checks=checks)
    by_metric = {r.metric: r for r in validation.rankings}
    assert set(by_metric) == set(RANK_METRICS)
    assert by_metric["tokens_per_s"].agreement is None
    tpot = by_metric["tpot_p50_s"]
    assert (tpot.compared, tpot.agreeing, tpot.agreement) == (2, 2, True)
    assert tpot.measured[-1] == 8
    ttft = by_metric["ttft_p99_s"]
    assert (ttft.compared, ttft.agreeing, ttft.agreement) == (2, 0, False)
    report = validation_dict(validation)["rankings"]
    assert report["tokens_per_s"]["agreement"] is None
    assert report["ttft_p99_s"] == {
        "predicted": [64, 16, 8],
        "measured": [8, 16, 64],
        "compared_pairs": 2,
        "agreeing_pairs": 0,
        "predicted_ties": 0,
        "agreement": False,
    }
    assert "2 of 2 pair(s) beyond the run-to-run noise ordered alike" in format_ranking(tpot)
    assert "predicted equal" not in format_ranking(tpot)


def _two_sizes():
    return Policy(
        deployment="tiny",
        model={"num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
               "dtype": "float32", "num_params": 1e5},
        kv_budget=64 * 16 * SLOT_BYTES,
        candidates=(8, 16),
    )  # fmt: skip


def test_live_runs_go_round_robin_over_the_block_sizes(model, monkeypatch):
    from blocktune.tuner.fidelity import validation

    served = []
    real = validation._live_run

    def recording(*args):
        served.append(args[-1].block_size)
        return real(*args)

    monkeypatch.setattr(validation, "_live_run", recording)
    workload = _workload([0.0, 0.1], [5, 9], [3, 3])
    result = validation.validate(
        workload, _two_sizes(), model, analytic_calibration(), (8, 16), runs=3, step_s=STEP_S
    )
    assert served == [8, 16, 8, 16, 8, 16]
    assert [len(c.measured_runs) for c in result.checks] == [3, 3]


def test_a_live_run_starts_on_a_warm_model_as_the_simulator_prices_it(monkeypatch):
    """The first product of a process packs its weights (0.6 s of SmolLM2's first step);
    a live run without a grid to time warms the model up before its first step."""
    from blocktune.runtime.linear import packs
    from blocktune.tuner.fidelity import validation

    fresh = load_weights("tiny-random", seed=0)
    if not packs(fresh.lm_head.weight):
        pytest.skip("this torch build packs no weights")
    products = (fresh.lm_head, fresh.model.layers[0].self_attn.qkv)
    packed_at_start = []

    def serving(engine, workload, **kwargs):
        packed_at_start.append([p._packed is not None for p in products])
        return serve_live(engine, workload, **kwargs)

    monkeypatch.setattr(validation, "serve_live", serving)
    workload = _workload([0.0, 0.1], [5, 9], [3, 3])
    validation.validate(
        workload, _two_sizes(), fresh, analytic_calibration(), (8, 16), step_s=STEP_S
    )
    assert packed_at_start == [[True, True]] * 4


@pytest.mark.slow
def test_live_runs_in_two_processes_measure_what_one_process_does(model):
    from blocktune.tuner.fidelity.validation import validate

    rng = np.random.default_rng(5)
    workload = _workload(np.sort(rng.uniform(0, 2, 12)), rng.integers(2, 40, 12), [6] * 12)
    results = [
        validate(workload, _two_sizes(), model, analytic_calibration(), (8, 16), step_s=STEP_S,
                 jobs=jobs)
        for jobs in (1, 2)
    ]  # fmt: skip
    for alone, shared in zip(*(r.checks for r in results), strict=True):
        assert alone.block_size == shared.block_size
        assert alone.measured_runs == shared.measured_runs
        # At a constant step time the simulator admits and finishes alike.
        assert alone.predicted == alone.measured_runs[0]


@pytest.mark.parametrize("jobs", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_bar_follows_the_live_runs_through_their_output_tokens(model, capsys, jobs):
    """A validation of SmolLM2 serves its live runs for 15-40 minutes: a bar shows how far
    they are (quiet where stderr is not a terminal), fed from the worker processes."""
    from blocktune.tuner.fidelity.validation import validate

    workload = _workload([0.0, 0.5, 1.0], [5, 9, 30], [40, 40, 40])
    args = (workload, _two_sizes(), model, analytic_calibration(), (8, 16))
    validate(*args, step_s=STEP_S, jobs=jobs, live_bar=True)
    shown = capsys.readouterr().err
    assert "live runs: 100%" in shown and "4.00/4" in shown
    validate(*args, step_s=STEP_S, jobs=jobs)  # stderr is not a terminal here
    assert "live runs" not in capsys.readouterr().err


def test_a_live_run_reports_each_percent_of_its_output_tokens_it_serves(model):
    import queue

    from blocktune.tuner.fidelity import validation

    workload = _workload([0.0, 0.5, 1.0], [5, 9, 30], [40, 40, 40])
    server = StepCostModel(_two_sizes(), analytic_calibration(), fixed_step_s=STEP_S)
    reports = queue.Queue()
    task = validation._LiveTask(3, 8, None)
    validation._live_run(model, server, workload, STEP_S, "wall", 0, None, "torch", reports, task)
    seen = [reports.get_nowait() for _ in range(reports.qsize())]
    assert {number for number, _ in seen} == {3}
    fractions = [fraction for _, fraction in seen]
    assert fractions[-1] == 1.0 and len(fractions) > 10
    # Each report at least 1% of the 120 output tokens past the one before.
    steps = zip(fractions[:-2], fractions[1:-1], strict=True)  # the last comes at 1 whatever
    assert all(b - a >= validation.LIVE_REPORT_FRACTION for a, b in steps)


def test_the_step_sensitivity_finds_the_step_scale_that_matches_the_measured_tpot():
    from dataclasses import replace

    from blocktune.tuner.fidelity.validation import step_sensitivity
    from blocktune.tuner.fidelity.validation_report import format_sensitivity

    rng = np.random.default_rng(3)
    workload = _workload(np.sort(rng.uniform(0, 4, 20)), rng.integers(4, 60, 20), [9] * 20)
    server = _server(200)
    predicted = ServedMetrics.of(simulate(workload, server, 8), workload)
    assert predicted.tpot_p50_s == STEP_S  # one token per step of a constant time
    # Steps 1.3x as long make every TPOT 1.3x: the search finds that scale within 1%.
    slower = replace(server, step_scale=1.3)
    measured = ServedMetrics.of(simulate(workload, slower, 8), workload)
    sensitivity = step_sensitivity(workload, server, 8, predicted, measured)
    assert sensitivity.tpot_p50_change == pytest.approx(0.1)
    assert sensitivity.matching_step_scale == pytest.approx(1.3, rel=0.01)
    # A TPOT no scale in 0.25-4x gives: no scale, and the report says so.
    far = replace(measured, tpot_p50_s=10 * STEP_S)
    assert step_sensitivity(workload, server, 8, predicted, far).matching_step_scale is None
    check = BlockSizeCheck(
        8, predicted, (far,), step_sensitivity(workload, server, 8, predicted, far)
    )
    validation = Validation(trace={}, setup={}, checks=[check])
    assert format_sensitivity(validation) == [
        "steps 10% longer move the predicted TPOT p50 by +10.0% (B=8)",
        "the step-time scale at which the predicted TPOT p50 is the measured one: "
        "none in 0.25-4x (B=8)",
    ]
    assert validation_dict(validation)["results"][0]["step_sensitivity"] == {
        "tpot_p50_change": pytest.approx(0.1),
        "matching_step_scale": None,
    }


def test_a_step_scale_must_be_positive():
    from dataclasses import replace

    with pytest.raises(ValueError, match="step_scale must be a positive number"):
        replace(_server(10), step_scale=0.0)


def test_the_pool_validate_serves_from_is_the_policy_budget_in_whole_blocks_of_each_size(model):
    from blocktune.tuner.fidelity.validation import pool_slots

    # 100 slots' worth of budget: 96 slots in blocks of 8 or 16 (6 of 16), 64 in blocks of 64.
    policy = _server(num_blocks=25, block_size=4).policy
    assert pool_slots(policy, model, analytic_calibration(), (8, 16)) == 96
    assert pool_slots(policy, model, analytic_calibration(), (8, 16, 64)) == 64


def _calibrated_server(spread: tuple[float, ...]) -> StepCostModel:
    """A SmolLM2-shaped deployment whose engine steps cost 10 ms plus 2 ms a request and
    1 ms per 100 prompt tokens, with `spread` as the calibration's step spread."""
    from blocktune.tuner.config.calibration import (
        EngineCalibration,
        FitResiduals,
        Provenance,
        StepCoefficients,
    )
    from blocktune.tuner.config.policy import ModelShape

    model = ModelShape(
        name="smollm2", num_layers=30, hidden_size=576, intermediate_size=1536, num_heads=9,
        num_kv_heads=3, head_dim=64, vocab_size=49152, dtype="float32",
    )  # fmt: skip
    steps = StepCoefficients(
        fixed_s=0.01, per_block_s=0.0, per_token_s=0.0, per_sequence_s=0.002,
        prefill_s_per_token=1e-5,
    )  # fmt: skip
    provenance = Provenance(kind="measured", device="cpu", date="2026-12-06", torch="x", grid={})
    engine = EngineCalibration(
        provenance=provenance,
        model=model,
        threads=1,
        steps={16: steps},
        residuals={16: FitResiduals(points=1, rms_relative=0, max_relative=0)},
        step_spread=spread,
    )
    calibration = analytic_calibration().model_copy(update={"provenance": provenance})
    policy = Policy(deployment="smol", model=model, kv_budget="64MiB", candidates=(16,))
    return StepCostModel(policy, calibration.with_engine(engine))


def test_a_prediction_takes_its_central_figures_at_the_fitted_times_and_its_tails_sampled():
    """With a step spread, the p50s, tokens/s, peak and preemptions are those of the run at
    the fitted step times, the p99s those of the run that draws each step's factor."""
    from dataclasses import replace

    rng = np.random.default_rng(4)
    workload = _workload(np.sort(rng.uniform(0, 3, 40)), rng.integers(10, 300, 40), [20] * 40)
    server = _calibrated_server((0.5, 0.7, 0.9, 1.0, 1.3, 1.6))
    fitted = ServedMetrics.of(
        simulate(workload, replace(server, sample_spread=False), 16), workload
    )
    sampled = ServedMetrics.of(simulate(workload, server, 16, seed=3), workload)
    # The two runs differ in every figure compared, so the test tells which run each is from.
    assert fitted.tpot_p50_s != sampled.tpot_p50_s and fitted.tpot_p99_s != sampled.tpot_p99_s
    assert fitted.ttft_p99_s != sampled.ttft_p99_s and fitted.tokens_per_s != sampled.tokens_per_s
    predicted = predict(workload, server, 16, seed=3)
    assert predicted == replace(
        fitted, ttft_p99_s=sampled.ttft_p99_s, tpot_p99_s=sampled.tpot_p99_s
    )
    # Without a spread the two runs are one: the prediction is the fitted run's.
    plain = _calibrated_server(())
    assert predict(workload, plain, 16) == ServedMetrics.of(simulate(workload, plain, 16), workload)
    assert predict(workload, plain, 16) == fitted
    assert prediction_method(plain) == "every step at its fitted time"
    assert prediction_method(server, 3).endswith("step spread, each held for 0.2 s (seed 3)")


def test_serve_live_reports_its_progress_through_the_output_tokens_after_every_step(model):
    workload = _workload([0.0, 0.0, 1.0], [5, 9, 4], [3, 4, 2])
    seen = []
    run = serve_live(_engine(model, 64), workload, step_s=STEP_S, between=seen.append)
    assert len(seen) == run.steps
    assert seen == sorted(seen)  # never backwards
    assert seen[-1] == 1.0
    # Two requests decode together from the start: two of nine tokens after the first step.
    assert seen[0] == pytest.approx(2 / 9)


def test_an_interleaved_grid_is_timed_between_the_live_runs_steps_and_prices_the_prediction(
    model, monkeypatch
):
    """validate measures the engine section itself: every grid point once, shared out to
    the live runs, each share timed as its run goes (not before it, not all after it)."""
    from blocktune.runtime import engine as engine_module
    from blocktune.tuner.fidelity import validation
    from blocktune.tuner.measure import engine_measure

    events = []
    real_step, real_time_next = engine_module.Engine.step, engine_measure.GridTimer.time_next
    live_engines = set()
    real_engine = validation._engine

    def live_engine(*args):
        engine = real_engine(*args)
        live_engines.add(id(engine))
        return engine

    def step(self):
        if id(self) in live_engines:
            events.append("step")
        return real_step(self)

    def time_next(self):
        events.append("point")
        return real_time_next(self)

    monkeypatch.setattr(validation, "_engine", live_engine)
    monkeypatch.setattr(engine_module.Engine, "step", step)
    monkeypatch.setattr(engine_measure.GridTimer, "time_next", time_next)
    grid = engine_measure.default_engine_grid(quick=True, block_sizes=(8, 16))
    rng = np.random.default_rng(2)
    workload = _workload(np.sort(rng.uniform(0, 1, 8)), rng.integers(4, 30, 8), [20] * 8)
    result = validation.validate(
        workload,
        _two_sizes(),
        model,
        analytic_calibration(),
        (8, 16),
        runs=2,
        interleave=validation.InterleavedGrid(grid, "tiny-random", "wall"),
    )
    assert events.count("point") == grid.num_points
    # Each of the four runs times its share while it serves: points between two steps.
    between = [
        i for i in range(1, len(events) - 1) if events[i - 1 : i + 2] == ["step", "point", "step"]
    ]
    assert len(between) >= 4
    engine = result.calibration.engine
    assert engine.clock == "wall"
    assert "between the steps of 4 live runs" in engine.provenance.notes
    timed = grid.num_points * grid.repeats  # every point once at each size
    assert {b: r.points for b, r in engine.residuals.items()} == {8: timed, 16: timed}
    assert result.setup["calibration"] == result.calibration.describe()
    assert result.setup["block_size_effect"] == engine.block_size_verdict()
    # Each size is predicted again with the fit's refits on resampled grid points: their
    # spread is the calibration's own noise, shown beside the run-to-run noise.
    assert result.setup["calibration_draws"] == validation.CALIBRATION_DRAWS
    for check in result.checks:
        assert len(check.predicted_draws) == validation.CALIBRATION_DRAWS
        tpot = [d.tpot_p50_s for d in check.predicted_draws]
        assert len(set(tpot)) > 1
        expected = np.std(tpot, ddof=1) / check.predicted.tpot_p50_s
        assert check.calibration_noise("tpot_p50_s") == pytest.approx(expected)
    noise = result.median_calibration_noise("tpot_p50_s")
    assert 0 < noise < 1
    table = format_validation_table(result)
    assert table.count("calib SD") == 3  # a row per block size and the summary
    assert f"TPOT p50 {noise:.1%}" in table.splitlines()[-1]
    assert validation_dict(result)["median_calibration_noise"]["tpot_p50_s"] == noise


def test_a_calibration_given_to_validate_has_no_noise_of_its_own_to_report():
    check = BlockSizeCheck(8, _metrics(1.0, 0.01, 0.1), (_metrics(1.0, 0.01, 0.1),) * 2)
    assert math.isnan(check.calibration_noise("tpot_p50_s"))
    result = Validation(trace={}, setup={"runs": 2}, checks=[check])
    assert "calib SD" not in format_validation_table(result)
    assert validation_dict(result)["results"][0]["calibration_noise"]["tpot_p50_s"] is None
