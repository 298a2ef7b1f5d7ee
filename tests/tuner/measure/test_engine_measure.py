"""`blocktune calibrate --engine` writes an engine section that the simulator prices steps with,
and `blocktune replay` and `blocktune validate` read it."""

import json
from dataclasses import replace

import pytest
import yaml

from blocktune.tuner.cli import main
from blocktune.tuner.config.calibration import (
    CalibrationError,
    analytic_calibration,
    load_calibration,
)
from blocktune.tuner.config.config_files import ConfigError
from blocktune.tuner.config.policy import load_policy
from blocktune.tuner.sim.step_cost import StepCostModel

TINY_POLICY = """\
deployment: tiny-cpu
model: {num_layers: 2, num_heads: 4, num_kv_heads: 2, head_dim: 16, dtype: float32,
        num_params: 1.0e+5}
kv_budget: 128KiB
candidates: [8, 16]
calibration: engine.yaml
"""


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """A quick engine calibration of tiny-random at block sizes 8 and 16, and a policy for it."""
    folder = tmp_path_factory.mktemp("engine-calibration")
    out = folder / "engine.yaml"
    args = ["calibrate", "--engine", "--quick", "--device", "cpu", "--block-sizes", "8", "16"]
    assert main([*args, "--threads", "1", "--clock", "cpu", "--out", str(out)]) == 0
    (folder / "tiny.yaml").write_text(TINY_POLICY, encoding="utf-8")
    return out, folder / "tiny.yaml"


def test_the_engine_section_records_model_fit_and_provenance(measured):
    path, _ = measured
    calibration = load_calibration(path)
    engine = calibration.engine
    assert calibration.block_sizes == (8, 16) and sorted(engine.steps) == [8, 16]
    assert engine.model.name == "tiny-random" and engine.model.num_layers == 2
    assert (engine.threads, engine.clock) == (1, "cpu")
    assert engine.provenance.kind == "measured" and engine.provenance.torch
    assert engine.provenance.grid["prefill_chunks"] == [16, 64]
    assert "step_s = fixed_s" in engine.provenance.notes
    # The kernel part is measured for the model's own attention shape.
    assert (calibration.kernel_shape.num_kv_heads, calibration.kernel_shape.head_dim) == (2, 16)
    # The quick grid: 2 x 2 decode batches, one of them also half at the shortest context,
    # and admissions of 1 and 4 prompts of 16 and 1 of 64 tokens, alone and beside a decode
    # batch: 11 points of 2 timed steps each, every step a row of the fit.
    for block_size, fit in engine.residuals.items():
        assert fit.points == 22 and 0 <= fit.rms_relative <= fit.max_relative, block_size
        assert engine.steps[block_size].fixed_s > 0
    # Shared terms once for all sizes (each times its size's scale, where the sizes' steps
    # differ), with standard errors; a verdict on B; a spread.
    scales = engine.size_scales or dict.fromkeys((8, 16), 1.0)
    unscaled = [
        {k: v / scales[b] for k, v in engine.steps[b] if k != "per_block_s"} for b in (8, 16)
    ]
    assert unscaled[0] == pytest.approx(unscaled[1], rel=1e-9)
    assert sorted(engine.standard_errors) == [8, 16]
    assert isinstance(engine.depends_on_block_size, bool)
    assert len(engine.step_spread) == 50 and engine.step_spread[0] > 0
    assert engine.provenance.grid["admissions"] == [1, 4]
    assert calibration.to_yaml() == path.read_text()  # the file reads back unchanged


def test_the_simulator_prices_steps_with_the_measured_coefficients(measured):
    path, policy_path = measured
    calibration = load_calibration(path)
    server = StepCostModel(load_policy(policy_path), calibration)
    for block_size in (8, 16):
        assert dict(calibration.engine.steps[block_size]) == vars(server.step_cost(block_size))
    # A kernel-only calibration still derives them from the kernel coefficients.
    derived = StepCostModel(load_policy(policy_path), analytic_calibration()).step_cost(8)
    assert derived.fixed_s != server.step_cost(8).fixed_s
    other = load_policy(policy_path).model_copy(
        update={"model": load_policy(policy_path).model.model_copy(update={"num_layers": 4})}
    )
    with pytest.raises(CalibrationError, match=r"num_layers 4 \(measured: 2\)"):
        StepCostModel(other, calibration)


def test_engine_steps_may_cover_fewer_block_sizes_than_the_kernel_but_no_others(measured, tmp_path):
    path, policy_path = measured
    data = yaml.safe_load(path.read_text())
    sections = ["steps", "residuals", "standard_errors"]
    sections += ["size_scales"] if data["engine"].get("size_scales") else []
    for section in sections:
        del data["engine"][section][16]
    (tmp_path / "fewer.yaml").write_text(yaml.safe_dump(data))
    fewer = load_calibration(tmp_path / "fewer.yaml")
    assert fewer.block_sizes == (8,)
    with pytest.raises(CalibrationError, match=r"no costs for block sizes \[16\]"):
        StepCostModel(load_policy(policy_path), fewer).step_cost(16)
    for section in sections:
        data["engine"][section][512] = data["engine"][section][8]
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"engine.steps covers block sizes \[8, 512\]"):
        load_calibration(tmp_path / "other.yaml")


@pytest.mark.slow
def test_replay_uses_the_engine_calibration_from_the_policy_or_the_flag(measured, capsys):
    path, policy_path = measured
    day = ["--duration", "3600", "--rate-scale", "0.002"]
    for extra in ([], ["--calibration", str(path)]):
        assert main(["replay", "--policy", str(policy_path), *day, *extra]) == 0
        out = capsys.readouterr().out
        assert "engine steps measured with tiny-random" in out and "static-16" in out


@pytest.mark.slow
def test_validate_prints_and_writes_the_comparison(measured, tmp_path, capsys):
    path, policy_path = measured
    out = tmp_path / "validation.json"
    args = ["validate", "--policy", str(policy_path), "--calibration", str(path)]
    args += ["--requests", "12", "--duration", "120", "--rate-scale", "0.05", "--runs", "2"]
    assert main([*args, "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "predicted" in table and "measured" in table and "ranking by tok/s" in table
    report = json.loads(out.read_text())
    assert set(report["rankings"]) == {"tokens_per_s", "tpot_p50_s", "ttft_p99_s"}
    for ranking in report["rankings"].values():
        assert sorted(ranking["predicted"]) == sorted(ranking["measured"]) == [8, 16]
        assert (ranking["agreement"] is None) == (ranking["compared_pairs"] == 0)
    assert "ranking by TPOT p50" in table and "ranking by TTFT p99" in table
    assert [r["block_size"] for r in report["results"]] == [8, 16]
    for result in report["results"]:
        assert len(result["measured_runs"]) == 2
        for side in ("predicted", "measured"):
            assert set(result[side]) >= {
                "tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s",
                "peak_kv_blocks",
            }  # fmt: skip
            assert result[side]["tokens_per_s"] > 0 and result[side]["peak_kv_blocks"] >= 1
        predicted, measured_mean = result["predicted"], result["measured"]
        runs = [r["tpot_p50_s"] for r in result["measured_runs"]]
        assert measured_mean["tpot_p50_s"] == pytest.approx(sum(runs) / 2)
        assert result["relative_error"]["tpot_p50_s"] == pytest.approx(
            predicted["tpot_p50_s"] / measured_mean["tpot_p50_s"] - 1
        )
    # A replay priced by the same calibration carries the check in its report...
    replay = ["replay", "--policy", str(policy_path), "--duration", "3600", "--rate-scale", "0.002"]
    replay += ["--validation", str(out), "--json", str(tmp_path / "report.json")]
    assert main([*replay, "--calibration", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "fidelity (blocktune validate on synthetic customer-service day" in printed
    fidelity = json.loads((tmp_path / "report.json").read_text())["fidelity"]
    assert fidelity["median_abs_error"] == report["median_abs_error"]
    assert fidelity["rankings"] == {
        metric: {k: r[k] for k in ("compared_pairs", "agreeing_pairs", "agreement")}
        for metric, r in report["rankings"].items()
    }
    assert fidelity["relative_error"]["16"] == report["results"][1]["relative_error"]
    # ... and a replay priced by another says the check does not describe it.
    analytic = tmp_path / "analytic.yaml"
    analytic.write_text(analytic_calibration().to_yaml())
    assert main([*replay, "--calibration", str(analytic)]) == 0
    warnings = json.loads((tmp_path / "report.json").read_text())["warnings"]
    assert any(
        w.startswith("the fidelity check was made with another calibration") for w in warnings
    )


def test_validate_needs_an_engine_calibration(measured, tmp_path, capsys):
    _, policy_path = measured
    kernel_only = tmp_path / "kernel.yaml"
    kernel_only.write_text(analytic_calibration().to_yaml())
    args = ["validate", "--policy", str(policy_path), "--calibration", str(kernel_only)]
    assert main(args) == 2
    assert "has no engine section" in capsys.readouterr().err


class DriftingClock:
    """A machine that slows down steadily: every step takes 1 ms more than the one before
    took, 0.2% more each step, whatever it computes."""

    def __init__(self):
        self.now, self.calls = 0.0, 0

    def __call__(self) -> float:
        self.calls += 1
        if self.calls % 2 == 0:  # the end of a timed step
            self.now += 1e-3 * (1 + 0.002 * self.calls)
        return self.now


@pytest.mark.slow
def test_a_drifting_machine_shows_no_block_size_effect_when_sizes_are_interleaved(monkeypatch):
    from blocktune.runtime.loading import load_weights
    from blocktune.tuner.config.calibration import B_INDEPENDENT
    from blocktune.tuner.measure import engine_measure

    clock = DriftingClock()
    monkeypatch.setitem(engine_measure.STEP_CLOCKS, "wall", clock)
    grid = engine_measure.default_engine_grid(quick=True, block_sizes=(8, 16))
    engine = engine_measure.measure_engine(
        load_weights("tiny-random", seed=0), "tiny", grid, "torch"
    )
    # 22 steps at each size, timed alternately: B=8 first at even points, B=16 at odd ones.
    assert clock.calls == 2 * 2 * 22
    assert not engine.depends_on_block_size
    assert engine.block_size_verdict() == B_INDEPENDENT
    assert engine.steps[8] == engine.steps[16]
    # Alike steps are priced at their mean: the measured total, 44 steps of 1 ms and the drift.
    total = sum(1e-3 * (1 + 0.002 * call) for call in range(2, clock.calls + 1, 2))
    assert clock.now == pytest.approx(total)


def test_a_grid_fitted_to_a_trace_reaches_its_longest_served_prompt_within_the_model():
    import numpy as np

    from blocktune.tuner.measure.engine_measure import default_engine_grid, grid_for_lengths

    grid = default_engine_grid(quick=False, block_sizes=(8, 16))
    prompts, totals = np.array([12, 700, 3000]), np.array([40, 900, 3300])
    fitted = grid_for_lengths(grid, prompts, totals, 8192)
    assert fitted.prefill_chunks[0] == min(grid.prefill_chunks)
    assert fitted.prefill_chunks[-1] == 3000 and fitted.context_lens[-1] == 3300
    assert len(fitted.prefill_chunks) == len(fitted.context_lens) == 4
    assert fitted.batch_sizes == grid.batch_sizes and fitted.admissions == grid.admissions
    # Within the model's positions: every request of the grid fits 2048 (one to spare).
    capped = grid_for_lengths(grid, np.array([12, 700, 2000]), np.array([40, 900, 2040]), 2048)
    assert capped.longest == 2047
    assert capped.prefill_chunks[-1] == 2000 and capped.context_lens[-1] < 2040
    # A request longer than the model is never served: the grid does not reach for it.
    served = grid_for_lengths(grid, prompts, totals, 2048)
    assert served.prefill_chunks[-1] == 700 and served.context_lens[-1] == 900


def test_the_grid_s_requests_hold_blocks_of_their_own():
    """Requests sharing a prompt would share its blocks, which a decode step then reads from
    the CPU's caches: each request of a grid point has a prompt of its own."""
    import numpy as np

    from blocktune.runtime.block_manager import blocks_for
    from blocktune.runtime.loading import load_weights
    from blocktune.tuner.measure import engine_measure

    grid = engine_measure.default_engine_grid(quick=True, block_sizes=(8,))
    engine = engine_measure._engine(load_weights("tiny-random", seed=0), grid, 8, "torch")
    timing = engine_measure._Timing(np.random.default_rng(0), engine_measure.STEP_CLOCKS["wall"])
    engine_measure._start(engine, timing, 4, 32, 2)
    # Each holds the K/V of its 32 prompt tokens and the token it sampled gets a slot next.
    assert engine.stats()["blocks_used"] == 4 * blocks_for(32, 8)


def test_a_grid_held_to_a_number_of_tokens_times_only_points_within_it():
    """A point whose requests hold more than `held_tokens` together is left out, and a decode
    batch cut short that way is timed where it holds that many instead."""
    import numpy as np

    from blocktune.tuner.measure import engine_measure

    grid = engine_measure.default_engine_grid(quick=False, block_sizes=(8, 16))
    fitted = engine_measure.grid_for_lengths(grid, np.array([12, 3000]), np.array([40, 3300]), 8192)
    held_to = replace(fitted, held_tokens=5600)

    def held(k: dict) -> int:
        if "long" in k:  # a decode batch
            return (k["short"] + k["long"]) * (k["context"] + fitted.growth)
        middle_context = fitted.context_lens[len(fitted.context_lens) // 2]
        return k["decoding"] * (middle_context + fitted.growth) + k["prompts"] * k["tokens"]

    kept = [point.keywords for point in engine_measure._points(held_to)]
    every = [point.keywords for point in engine_measure._points(fitted)]
    assert all(held(k) <= 5600 for k in kept)
    assert any(held(k) > 5600 for k in every)
    assert [k for k in every if held(k) <= 5600] == [k for k in kept if k in every]
    for batch in (8, 32):
        contexts = [k["context"] for k in kept if k.get("long") == batch and k["short"] == 0]
        assert max(contexts) == 5600 // batch - fitted.growth
        assert max(contexts) not in fitted.context_lens
    # Every context is still timed with one request, and every admission alone.
    assert {k["context"] for k in kept if k.get("long") == 1} == set(fitted.context_lens)
    alone = {(k["prompts"], k["tokens"]) for k in kept if k.get("decoding") == 0}
    assert alone == set(fitted.admission_points)


def test_a_grid_for_a_small_pool_holds_the_pool_or_a_gibibyte_of_k_v_and_the_batch_it_holds():
    """validate serves from the policy's pool: its grid holds no point of more than that pool
    or `GRID_POINT_KV_BYTES` of K/V (SmolLM2's whole grid on the Azure lengths held 6 GB a
    point, in each of two processes, and the system killed one), and times the batch the
    pool holds (a 128 KiB pool's steps of 1-3 requests, on a grid of 1, 8 and 32, were priced
    at 1/0.88 the time matching their TPOT p50)."""
    from blocktune.runtime.loading import load_weights
    from blocktune.tuner.measure import engine_measure

    model = load_weights("tiny-random", seed=0)
    per_token = engine_measure.model_shape(model).kv_bytes_per_token
    grid = engine_measure.default_engine_grid(quick=False, block_sizes=(8,))
    small = engine_measure.grid_for_pool(grid, model, 256)
    assert small.held_tokens == engine_measure.GRID_POINT_KV_BYTES // per_token
    large = 4 * engine_measure.GRID_POINT_KV_BYTES // per_token
    held_large = engine_measure.grid_for_pool(grid, model, large)
    assert held_large.held_tokens == large
    # A pool that holds fewer requests than the grid's largest batch adds the batch it holds
    # at the shortest context (256 // (32 + 12 tokens of growth) = 5); nothing else changes.
    assert grid.batch_sizes == (1, 8, 32) and grid.growth == 12
    assert small.batch_sizes == (1, 5, 8, 32)
    assert held_large.batch_sizes == grid.batch_sizes
    assert replace(small, held_tokens=None, batch_sizes=grid.batch_sizes) == grid


def test_a_held_grid_runs_every_point_on_a_pool_of_its_size():
    """The grid's engines hold `held_tokens` (and a block of rounding a request), not a
    batch of the longest requests: the prefix cache walks a pool through all of its blocks,
    so a pool sized for the largest batch at the longest context took that much memory
    whether or not any point held it."""
    from blocktune.runtime.loading import load_weights
    from blocktune.tuner.measure import engine_measure

    model = load_weights("tiny-random", seed=0)
    grid = replace(
        engine_measure.default_engine_grid(quick=True, block_sizes=(8,)), held_tokens=200
    )
    rows = max(grid.batch_sizes) + max(grid.admissions) + 2
    engine = engine_measure._engine(model, grid, 8, "torch")
    assert engine.kv.num_slots == (-(-200 // 8) + 2 * rows) * 8
    whole = engine_measure._engine(model, replace(grid, held_tokens=None), 8, "torch")
    assert whole.kv.num_slots > engine.kv.num_slots
    count = len(engine_measure._points(grid))
    steps = engine_measure._time_points(model, grid, "torch", "wall", 0, (0, range(count)))
    assert len(steps) == count * grid.repeats
    assert max(step.context_tokens for step in steps) <= 200


def test_a_grid_timer_times_its_share_as_far_as_it_is_asked_and_the_rest_when_closed():
    from blocktune.runtime.loading import load_weights
    from blocktune.tuner.measure import engine_measure

    model = load_weights("tiny-random", seed=0)
    grid = engine_measure.default_engine_grid(quick=True, block_sizes=(8, 16))
    share = range(1, grid.num_points, 2)
    timer = engine_measure.GridTimer(model, grid, "torch", "wall", 0, (1, share))
    assert timer.timed == 0
    timer.time_until(0.5)
    assert timer.timed == -(-len(share) // 2)  # half of the share, rounded up
    timer.time_until(0.5)  # asked again: nothing more
    assert timer.timed == -(-len(share) // 2)
    steps = timer.close()
    assert timer.timed == len(share)
    # Every point of the share at both sizes, `repeats` steps each.
    assert len(steps) == len(share) * 2 * grid.repeats
    assert {s.block_size for s in steps} == {8, 16}


def test_admission_steps_alternate_a_token_count_new_to_the_process_and_a_repeat():
    """A step of a token count the process computed before is cheaper (the CPU's kernels are
    cached per shape), and whether served steps repeat their counts depends on the
    workload, so the grid times both: every other admission step at a count no step before
    it had (the prompts' lengths at the chunk but for the last, moved by as few tokens as
    it takes), the others at the count of the step before, each flagged for the fit."""
    import numpy as np

    from blocktune.runtime.loading import load_weights
    from blocktune.tuner.measure import engine_measure

    timing = engine_measure._Timing(np.random.default_rng(0), engine_measure.STEP_CLOCKS["wall"])
    timing.step_tokens.add(32)  # a decode point's prefill of one 32-token prompt
    assert timing.fresh_lengths(1, 32, 0) == [33]
    assert timing.fresh_lengths(1, 32, 0) == [31]
    assert timing.fresh_lengths(4, 8, 2) == [8, 8, 8, 8]  # 34 tokens: new
    assert timing.fresh_lengths(4, 8, 2) == [8, 8, 8, 9]
    assert timing.fresh_lengths(4, 8, 2) == [8, 8, 8, 10]  # 34, 35 and 33 computed: 36

    model = load_weights("tiny-random", seed=0)
    grid = engine_measure.default_engine_grid(quick=True, block_sizes=(8, 16))
    timer = engine_measure.GridTimer(model, grid, "torch", "wall", 0, (0, range(grid.num_points)))
    admissions = [step for step in timer.close() if step.prompt_chunks]
    assert len(admissions) == 2 * len(grid.admission_points) * 2 * grid.repeats
    counts = [s.sequences - s.prompt_chunks + s.prefill_tokens for s in admissions]
    new = [count for count, s in zip(counts, admissions, strict=True) if s.new_count]
    fresh_repeats = len(range(0, grid.repeats, 2))  # the first, third... of each point's
    assert len(set(new)) == len(new) == 2 * len(grid.admission_points) * 2 * fresh_repeats
    for i, step in enumerate(admissions):
        if not step.new_count:  # the count of the step before, at the same engine
            assert counts[i] == counts[i - 1] and admissions[i - 1].new_count
        per_prompt = step.prefill_tokens / step.prompt_chunks
        assert min(abs(per_prompt - chunk) for chunk in grid.prefill_chunks) <= 16


def products_packed(model) -> list[bool]:
    """Whether each of `model`'s products holds its oneDNN-packed weight."""
    products = [model.lm_head]
    for layer in model.model.layers:
        products += [layer.self_attn.qkv, layer.self_attn.o_proj, layer.mlp.gate_up]
        products.append(layer.mlp.down_proj)
    return [product._packed is not None for product in products]


def test_warming_a_model_up_pays_its_first_products_before_anything_is_timed():
    from blocktune.runtime.linear import packs
    from blocktune.runtime.loading import load_weights
    from blocktune.tuner.measure import engine_measure

    model = load_weights("tiny-random", seed=0)
    if not packs(model.lm_head.weight):
        pytest.skip("this torch build packs no weights")
    assert not any(products_packed(model))
    engine_measure.warm_up_model(model, "torch")
    assert all(products_packed(model))
