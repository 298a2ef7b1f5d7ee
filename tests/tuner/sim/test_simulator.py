"""The serving simulator: conservation, pool limits, preemption, step times, prefix reuse,
block-size switches, and padding/peak against a direct BlockManager replay."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from blocktune.traces.synth import customer_service_day
from blocktune.tuner.config.calibration import StepCoefficients, analytic_calibration
from blocktune.tuner.config.policy import Policy, load_policy
from blocktune.tuner.measure.block_replay import replay_block_manager
from blocktune.tuner.replay.controllers import OracleController
from blocktune.tuner.sim.cost_model import CostModel
from blocktune.tuner.sim.simulator import simulate
from blocktune.tuner.sim.step_cost import StepCostModel
from blocktune.tuner.sim.workload import Workload

POLICIES = Path(__file__).resolve().parents[3] / "policies"
POLICY = load_policy(POLICIES / "customer_service_llama8b.yaml")
CALIBRATION = analytic_calibration()
SLOT = POLICY.model.kv_bytes_per_token  # 128 KiB


def with_budget(slots: int, **changes) -> Policy:
    """The customer-service policy with a KV budget of `slots` token slots."""
    return Policy.model_validate({**POLICY.model_dump(), "kv_budget": slots * SLOT, **changes})


def busy_day(seed: int = 1) -> pd.DataFrame:
    """About 1900 requests in 10 minutes (3 per second), prefixes included."""
    return customer_service_day(seed, duration_s=600.0, rate_scale=0.012)


def check_conservation(workload: Workload, run) -> None:
    """Every request finished with all its tokens, in order of time."""
    assert np.array_equal(run.generated, workload.output_tokens)
    assert not np.isnan(run.finish_s).any()
    assert (run.first_token_s > workload.arrival_s).all()
    assert (run.finish_s >= run.first_token_s).all()
    assert run.used_slot_steps <= run.allocated_slot_steps


@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
def test_ample_pool_conserves_tokens_and_never_preempts(block_size):
    workload = Workload.from_frame(busy_day())
    server = StepCostModel(with_budget(1 << 20), CALIBRATION)
    run = simulate(workload, server, block_size)
    check_conservation(workload, run)
    assert run.preemptions == 0
    assert run.steps >= workload.output_tokens.max()
    assert 0 < run.peak_blocks <= server.num_blocks(block_size)


@pytest.mark.parametrize("block_size", [8, 16, 64])
def test_tiny_pool_preempts_without_over_allocation(block_size):
    workload = Workload.from_frame(busy_day())
    policy = with_budget(1024)  # 128 MiB; the longest request (520 tokens) still fits alone
    server = StepCostModel(policy, CALIBRATION)
    run = simulate(workload, server, block_size)
    check_conservation(workload, run)
    assert run.preemptions > 0
    assert run.peak_blocks <= server.num_blocks(block_size)
    assert run.peak_kv_bytes <= int(policy.kv_budget)
    ample = simulate(workload, StepCostModel(with_budget(1 << 20), CALIBRATION), block_size)
    assert run.busy_s > ample.busy_s  # smaller batches and recomputed prompts cost time
    assert run.peak_kv_bytes < ample.peak_kv_bytes


def test_a_request_larger_than_the_pool_is_refused():
    frame = pd.DataFrame({"arrival_s": [0.0], "prompt_tokens": [900], "output_tokens": [200]})
    with pytest.raises(ValueError, match="1100 tokens does not fit the pool of 64 blocks"):
        simulate(Workload.from_frame(frame), StepCostModel(with_budget(1024), CALIBRATION), 16)


@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
def test_padding_and_peak_equal_a_direct_block_manager_replay(block_size):
    """Same steps as `replay_block_manager` (fixed step time, a pool nothing waits for): the
    same steps, peak blocks and allocated slot-steps, hence the same padding ratio, which is
    also the cost model's padding ratio of the whole trace. The block replay and the cost
    model count the token a step samples as held (p + t tokens in the t-th step), the
    simulator, like the engine, its K/V only (p + t - 1): so the simulator serves the
    prompts one token longer here."""
    day = busy_day(seed=3).drop(columns=["prefix_hashes", "prefix_group"])
    workload = Workload.from_frame(day)
    longer = Workload.from_frame(day.assign(prompt_tokens=day["prompt_tokens"] + 1))
    policy = with_budget(1 << 22)
    run = simulate(longer, StepCostModel(policy, CALIBRATION, fixed_step_s=0.05), block_size)
    direct = replay_block_manager(day, block_size, step_s=0.05)
    assert run.steps == direct.steps
    assert run.peak_blocks == direct.peak_blocks
    assert run.allocated_slot_steps == direct.allocated_slot_steps
    assert run.padding_ratio == pytest.approx(direct.padding_ratio, abs=1e-12)
    (cost,) = CostModel(policy, CALIBRATION).costs(
        workload.prompt_tokens, workload.output_tokens, block_sizes=(block_size,)
    )
    assert run.padding_ratio == pytest.approx(cost.padding_ratio, abs=1e-12)


def test_step_times_follow_the_calibration():
    """One request alone: its first step prefills the prompt, then one token per step."""
    prompt, output, size = 100, 5, 16
    frame = pd.DataFrame({"arrival_s": [0.0], "prompt_tokens": [prompt], "output_tokens": [output]})
    server = StepCostModel(POLICY, CALIBRATION)
    run = simulate(Workload.from_frame(frame), server, size)
    kernel = CostModel(POLICY, CALIBRATION).kernel(size)
    layers = POLICY.model.num_layers
    weights = POLICY.model.weight_bytes / CALIBRATION.memory_bandwidth_bytes_per_s
    prefill = prompt * 2 * POLICY.model.num_params / CALIBRATION.compute_flops_per_s
    steps = [
        weights
        + layers * (kernel.launch_s + kernel.per_block_s * -(-held // size))
        + layers * kernel.per_token_s * held
        + CALIBRATION.host_s_per_token[size]
        for held in range(prompt, prompt + output)
    ]
    assert run.first_token_s[0] == pytest.approx(prefill + steps[0], rel=1e-12)
    assert run.finish_s[0] == pytest.approx(prefill + sum(steps), rel=1e-12)
    assert run.busy_s == pytest.approx(run.finish_s[0], rel=1e-12)


class ExactTerms(StepCostModel):
    """Every size's step costs exactly the `terms` given, the other terms 0."""

    def __init__(self, policy, calibration, **terms):
        super().__init__(policy, calibration)
        shared = ("fixed_s", "per_block_s", "per_token_s", "per_sequence_s", "prefill_s_per_token")
        self._steps = StepCoefficients(**dict.fromkeys(shared, 0.0) | terms)

    def step_cost(self, block_size: int) -> StepCoefficients:
        return self._steps


def test_a_padded_batch_costs_its_longest_context_and_a_prompt_its_pairs():
    """Two requests admitted together (prompts 100 and 20): the first step computes both
    prompts (100 x 100 + 20 x 20 pairs) and every step reads the batch padded to the longer
    one's context; once it leaves, the short one pays for its own."""
    frame = pd.DataFrame(
        {"arrival_s": [0.0, 0.0], "prompt_tokens": [100, 20], "output_tokens": [3, 5]}
    )
    model = ExactTerms(
        POLICY, CALIBRATION, fixed_s=0.01, per_padded_token_s=1e-5, prefill_s_per_pair=1e-8
    )
    run = simulate(Workload.from_frame(frame), model, 16)
    steps = [0.01 + 2 * ctx * 1e-5 for ctx in (100, 101, 102)]
    steps += [0.01 + ctx * 1e-5 for ctx in (23, 24)]
    steps[0] += (100 * 100 + 20 * 20) * 1e-8
    assert run.first_token_s.tolist() == pytest.approx([steps[0]] * 2, rel=1e-12)
    assert run.finish_s.tolist() == pytest.approx([sum(steps[:3]), sum(steps)], rel=1e-12)


def admissions_model(policy) -> ExactTerms:
    """Steps of 10 ms plus 1 ms per prompt chunk, nothing else."""
    return ExactTerms(policy, CALIBRATION, fixed_s=0.01, per_admission_s=0.001)


def test_each_admitted_prompt_costs_its_admission():
    """Three requests admitted in one step pay three admissions in it; a later one its own.
    With chunked prefill, each step pays for the prompts it computes a chunk of."""
    frame = pd.DataFrame(
        {"arrival_s": [0.0, 0.0, 0.0, 1.0], "prompt_tokens": [40, 20, 30, 10],
         "output_tokens": [2, 2, 2, 2]}
    )  # fmt: skip
    run = simulate(Workload.from_frame(frame), admissions_model(POLICY), 16)
    assert run.first_token_s.tolist() == pytest.approx([0.013] * 3 + [1.011], rel=1e-12)
    assert run.finish_s.tolist() == pytest.approx([0.023] * 3 + [1.021], rel=1e-12)
    # A budget of 32 tokens: step 1 computes 32 of the first prompt, step 2 its last 8 and
    # 20 + 4 of the next two (3 chunks), step 3 the third's last 26 beside 2 decodes.
    chunked = admissions_model(with_budget(8192, batch={"max_num_batched_tokens": 32}))
    run = simulate(Workload.from_frame(frame.head(3)), chunked, 16)
    assert run.first_token_s.tolist() == pytest.approx([0.024, 0.024, 0.035], rel=1e-12)


def test_only_a_step_of_a_token_count_not_computed_before_pays_a_new_count():
    """Steps of 10 ms plus 1 ms where the step's number of tokens (its decodes and prompt
    tokens) is one no step before it computed. One request at a time, prompts of 40, 40,
    30 and 40 tokens: the first and third prompt steps pay it, the others repeat a count.
    A 40-token prompt admitted while another request decodes is a step of 41 tokens: new."""
    frame = pd.DataFrame(
        {"arrival_s": [0.0, 1.0, 2.0, 3.0, 3.5], "prompt_tokens": [40, 40, 30, 40, 40],
         "output_tokens": [2, 2, 2, 400, 2]}
    )  # fmt: skip
    workload = Workload.from_frame(frame)
    model = ExactTerms(POLICY, CALIBRATION, fixed_s=0.01, per_new_count_s=0.001)
    run = simulate(workload, model, 16)
    assert run.first_token_s[:4].tolist() == pytest.approx([0.011, 1.01, 2.011, 3.01], rel=1e-12)
    assert run.finish_s[:3].tolist() == pytest.approx([0.021, 1.02, 2.021], rel=1e-12)
    flat = simulate(workload, ExactTerms(POLICY, CALIBRATION, fixed_s=0.01), 16)
    assert run.first_token_s[4] - flat.first_token_s[4] == pytest.approx(0.001, rel=1e-9)


def test_a_decode_step_s_token_count_is_one_computed():
    """A one-token prompt admitted alone is a step of one token, as every decode step of a
    lone request was before it: no new count."""
    frame = pd.DataFrame(
        {"arrival_s": [0.0, 1.0], "prompt_tokens": [40, 1], "output_tokens": [3, 2]}
    )
    model = ExactTerms(POLICY, CALIBRATION, fixed_s=0.01, per_new_count_s=0.001)
    run = simulate(Workload.from_frame(frame), model, 16)
    assert run.first_token_s.tolist() == pytest.approx([0.011, 1.01], rel=1e-12)


class Spread(StepCostModel):
    """Fixed 10 ms steps with a step spread of factors 0.5 to 2.0 around a mean of 1."""

    @property
    def step_spread(self) -> tuple[float, ...]:
        return (0.5, 0.6, 0.8, 1.0, 1.1, 2.0)


def one_at_a_time(count: int, outputs: int) -> Workload:
    """`count` requests of 8-token prompts and `outputs` tokens, all queued at 0 and served
    one at a time: the engine is busy without a break."""
    frame = pd.DataFrame(
        {"arrival_s": np.zeros(count), "prompt_tokens": 8, "output_tokens": outputs}
    )
    return Workload.from_frame(frame)


SERIAL = {"batch": {"max_num_seqs": 1}}


def test_a_step_spread_is_sampled_with_a_seed_and_held_factors_weigh_the_steps_by_time():
    workload = Workload.from_frame(busy_day())
    policy = with_budget(8192)
    plain = simulate(workload, StepCostModel(policy, CALIBRATION, fixed_step_s=0.01), 16)
    spread = Spread(policy, CALIBRATION, fixed_step_s=0.01)
    runs = [simulate(workload, spread, 16, seed=seed) for seed in (0, 0, 1)]
    assert runs[0].finish_s.tolist() == runs[1].finish_s.tolist()  # seeded
    assert runs[0].finish_s.tolist() != runs[2].finish_s.tolist()
    for run in runs:
        check_conservation(workload, run)
    assert plain.busy_s / plain.steps == pytest.approx(0.01)
    spread_tpot = (runs[0].finish_s - runs[0].first_token_s) / np.maximum(
        1, workload.output_tokens - 1
    )
    plain_tpot = (plain.finish_s - plain.first_token_s) / np.maximum(1, workload.output_tokens - 1)
    assert np.percentile(spread_tpot, 99) > np.percentile(plain_tpot, 99)
    # Served back to back (about 2,000 held factors, drawn uniformly), a stretch of factor f
    # holds 1/f times as many steps as one of factor 1: the steps average 1 / mean(1 / f).
    serial = Spread(with_budget(8192, **SERIAL), CALIBRATION, fixed_step_s=0.01)
    harmonic = 1 / np.mean(1 / np.array(serial.step_spread))  # 0.82
    for seed in (0, 1):
        run = simulate(one_at_a_time(400, 100), serial, 16, seed=seed)
        assert run.busy_s / run.steps == pytest.approx(0.01 * harmonic, rel=0.03)


def test_a_drawn_step_factor_holds_for_a_stretch_of_simulated_time(monkeypatch):
    """Held for `SPREAD_HOLD_S`, a factor slows or speeds all of a short request's steps at
    once, so TPOTs spread as widely as the factors; drawn per step, they average out."""
    from blocktune.tuner.sim import simulator

    workload = one_at_a_time(200, 11)  # ten gaps of 5-20 ms: one request within one hold
    serial = Spread(with_budget(8192, **SERIAL), CALIBRATION, fixed_step_s=0.01)

    def tpots(hold: float) -> np.ndarray:
        monkeypatch.setattr(simulator, "SPREAD_HOLD_S", hold)
        run = simulate(workload, serial, 16, seed=3)
        return (run.finish_s - run.first_token_s) / 10

    held, per_step = tpots(simulator.SPREAD_HOLD_S), tpots(0.0)
    # Most requests lie within one stretch: their TPOT is one of the factors times 10 ms.
    on_a_factor = np.isclose(held[:, None], 0.01 * np.array(serial.step_spread)).any(axis=1)
    assert on_a_factor.mean() > 0.5
    assert np.percentile(held, 99) > 0.018  # near the slowest factor, 2 x 10 ms
    assert np.percentile(per_step, 99) < 0.016
    assert held.std() > 2 * per_step.std()


def prefix_requests(arrivals, prompts, outputs, hashes) -> Workload:
    return Workload.from_frame(
        pd.DataFrame(
            {
                "arrival_s": arrivals,
                "prompt_tokens": prompts,
                "output_tokens": outputs,
                "prefix_hashes": pd.Series(hashes, dtype=object),
            }
        )
    )


def test_a_shared_prefix_is_held_once():
    """Two 300-token prompts with one 256-token prefix hash at B=16: the second request
    takes the first's 16 prefix blocks, so together they hold 19 + 3 blocks, not 38."""
    workload = prefix_requests([0.0, 0.01], [300, 300], [2, 2], [[7], [7]])
    server = StepCostModel(with_budget(4096), CALIBRATION, fixed_step_s=0.05)
    assert simulate(workload, server, 16).peak_blocks == 22
    unshared = prefix_requests([0.0, 0.01], [300, 300], [2, 2], [[7], [8]])
    assert simulate(unshared, server, 16).peak_blocks == 38


def test_released_prefix_blocks_are_reused_until_evicted():
    """A finished request's prefix blocks stay cached: a later request prefills only its
    last 44 tokens. A 601-token request in between needs 38 of the 40 blocks and evicts the
    least recently released: the 14 last prefix blocks (freed last to first), so only the
    first 2 (32 tokens) are still there."""
    size, server = 16, StepCostModel(with_budget(640), CALIBRATION)
    cost = server.step_cost(size)

    def first_step(prefilled: int) -> float:
        return (
            cost.fixed_s
            + cost.per_block_s * 19
            + cost.per_token_s * 300
            + cost.per_sequence_s
            + cost.prefill_s_per_token * prefilled
        )

    cached = prefix_requests([0.0, 10.0], [300, 300], [1, 1], [[7], [7]])
    run = simulate(cached, server, size)
    assert run.first_token_s[1] - 10.0 == pytest.approx(first_step(44), rel=1e-12)
    evicted = prefix_requests([0.0, 5.0, 10.0], [300, 600, 300], [1, 1, 1], [[7], [], [7]])
    run = simulate(evicted, server, size)
    assert run.first_token_s[2] - 10.0 == pytest.approx(first_step(300 - 32), rel=1e-12)


def test_switches_keep_conservation_and_the_pool_limit():
    """An oracle schedule 16 -> 8 -> 64 -> 32 on a tight pool: every switch happens at its
    interval boundary, no request loses a token and no size over-allocates."""
    workload = Workload.from_frame(busy_day())
    policy = with_budget(1024, interval="150s")
    server = StepCostModel(policy, CALIBRATION)
    schedule = np.array([16, 8, 64, 32])
    run = simulate(workload, server, 16, controller=OracleController(150.0, schedule))
    check_conservation(workload, run)
    assert [(b, size) for b, _, size in run.switches] == [(1, 8), (2, 64), (3, 32)]
    assert all(150.0 * b <= t < 150.0 * b + 1 for b, t, _ in run.switches)
    assert run.swaps == 3 and run.swap_pause_s == 0.0
    assert run.peak_kv_bytes <= int(policy.kv_budget)


def test_swap_pause_is_the_plans_copy_plus_the_engines_pause():
    """A swap costs the policy's pause plus the planned bytes at the copy bandwidth; for vLLM
    the pause is a restart."""
    policy = with_budget(4096, swap_pause="20ms")
    server = StepCostModel(policy, CALIBRATION)
    assert server.swap_pause_s() == pytest.approx(0.02)
    moved = 1000 * SLOT
    expected = 0.02 + moved / CALIBRATION.copy_bandwidth_bytes_per_s
    assert server.swap_pause_s(moved) == pytest.approx(expected)
    vllm = with_budget(4096, engine="vllm", candidates=[16, 32, 64], restart="45s")
    assert StepCostModel(vllm, CALIBRATION).swap_pause_s() == pytest.approx(45.0)


def requests_at(arrivals, prompts, outputs) -> Workload:
    return Workload.from_frame(
        pd.DataFrame({"arrival_s": arrivals, "prompt_tokens": prompts, "output_tokens": outputs})
    )


def test_the_batch_holds_at_most_max_num_seqs_requests():
    """Ten equal requests at once with room for four: they run in waves of four."""
    policy = with_budget(8192, batch={"max_num_seqs": 4})
    server = StepCostModel(policy, CALIBRATION, fixed_step_s=0.01)
    run = simulate(requests_at([0.0] * 10, [20] * 10, [5] * 10), server, 16)
    waves = np.unique(np.round(run.first_token_s, 9))
    assert len(waves) == 3
    assert np.bincount(np.searchsorted(waves, np.round(run.first_token_s, 9))).tolist() == [4, 4, 2]
    assert run.first_token_s[4] == pytest.approx(run.finish_s[0] + 0.01)


def test_chunked_prefill_spreads_a_long_prompt_over_steps_beside_the_decodes():
    """A 1000-token prompt with a budget of 256 tokens per step takes four steps to prefill
    while a running request keeps decoding (255 prefill tokens beside it); without a budget it
    makes its first token in its admission step."""
    workload = requests_at([0.0, 0.001], [10, 1000], [50, 5])
    whole = StepCostModel(with_budget(8192), CALIBRATION, fixed_step_s=0.01)
    chunked = StepCostModel(
        with_budget(8192, batch={"max_num_batched_tokens": 256}), CALIBRATION, fixed_step_s=0.01
    )
    at_once, spread = simulate(workload, whole, 16), simulate(workload, chunked, 16)
    assert at_once.first_token_s[1] == pytest.approx(0.02)  # admitted in step 2
    assert spread.first_token_s[1] == pytest.approx(0.02 + 3 * 0.01)  # 4 chunks of <= 255
    assert spread.finish_s[0] == pytest.approx(at_once.finish_s[0])  # decodes never wait
    check_conservation(workload, spread)
    # Prefill time is charged per chunk: the same prompt tokens, in steps that decode anyway.
    timed = StepCostModel(with_budget(8192, batch={"max_num_batched_tokens": 256}), CALIBRATION)
    untimed = StepCostModel(with_budget(8192), CALIBRATION)
    chunked_run, whole_run = simulate(workload, timed, 16), simulate(workload, untimed, 16)
    assert chunked_run.steps == whole_run.steps
    assert chunked_run.busy_s == pytest.approx(whole_run.busy_s, rel=1e-3)
