"""What `blocktune validate` says of the requests it leaves out: how many, the limit and
what sets it (the model's positions or the KV pool)."""

import pandas as pd
import pytest

from blocktune.runtime.loading import load_weights
from blocktune.tuner.config.calibration import analytic_calibration
from blocktune.tuner.config.policy import Policy
from blocktune.tuner.fidelity.validation import validate
from blocktune.tuner.fidelity.validation_report import format_left_out
from blocktune.tuner.sim.workload import Workload

SLOT_BYTES = 2 * 2 * 16 * 4 * 2  # tiny-random: layers x K/V heads x head_dim x fp32 x (K, V)
POSITIONS = 4096  # tiny-random's max_position_embeddings


@pytest.fixture(scope="module")
def model():
    return load_weights("tiny-random", seed=0)


def _validated(model, slots: int, prompts: list[int]):
    policy = Policy(
        deployment="tiny",
        model={"num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
               "dtype": "float32", "num_params": 1e5},
        kv_budget=slots * SLOT_BYTES,
        candidates=(16,),
    )  # fmt: skip
    frame = pd.DataFrame(
        {"arrival_s": range(len(prompts)), "prompt_tokens": prompts, "output_tokens": 2}
    )
    workload = Workload.from_frame(frame)
    return validate(workload, policy, model, analytic_calibration(), (16,), runs=1, step_s=0.25)


def test_requests_past_the_models_positions_are_said_to_be_left_out_for_them(model):
    validation = _validated(model, slots=2 * POSITIONS, prompts=[5, 9, POSITIONS, 7])
    assert validation.trace["too_long"] == 1
    assert format_left_out(validation.trace) == (
        f"left out 1 request longer than {POSITIONS} tokens "
        "(the model's positions, max_position_embeddings)"
    )


def test_requests_past_the_pool_are_said_to_be_left_out_for_it(model):
    validation = _validated(model, slots=64, prompts=[5, 90, 70, 7])
    assert validation.trace["too_long"] == 2
    assert format_left_out(validation.trace) == (
        "left out 2 requests longer than 64 tokens (the smallest KV pool of the block sizes "
        "compared)"
    )
    assert format_left_out(_validated(model, slots=64, prompts=[5, 7]).trace) is None
