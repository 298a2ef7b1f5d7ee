"""`calibrate --engine vllm`: steps read from streamed token times, fitted to the step form.

The fake vLLM (tests/fake_vllm.py) batches requests like vLLM's scheduler and sleeps each
step for the step form at known coefficients; the calibration fitted from its streams must
recover them."""

import json
import math
import shlex
import sys
from pathlib import Path

import pytest

from blocktune.tuner.cli import main
from blocktune.tuner.config.calibration import load_calibration, prefill_pairs
from blocktune.tuner.measure.step_fit import TimedStep, fit_steps, predict_step_s
from blocktune.tuner.measure.vllm_measure import (
    SEGMENT_TOKENS,
    StreamedRequest,
    VllmGrid,
    hf_model_shape,
    timed_steps,
)
from blocktune.tuner.measure.vllm_server import VllmServer, VllmStartError

FAKE_VLLM = Path(__file__).resolve().parents[2] / "fake_vllm.py"
TRUE = {
    "fixed_s": 0.01,
    "per_sequence_s": 0.002,
    "per_token_s": 1e-5,
    "prefill_s_per_token": 5e-5,
}
"""Steps of 10-40 ms: a loaded machine's scheduling delays stay a small part of them."""
SMOLLM2_CONFIG = {
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
}


def fake_template(**coefficients: float) -> str:
    step = ",".join(f"{k}={v}" for k, v in coefficients.items())
    return (
        shlex.join([sys.executable, str(FAKE_VLLM), "--start-delay", "0.1", "--step", step])
        + " --port {port} --block-size {block_size}"
    )


def model_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "smollm2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    return folder


def true_step(step: TimedStep) -> float:
    """What the fake sleeps for a step with these features."""
    return (
        TRUE["fixed_s"]
        + TRUE["per_sequence_s"] * step.sequences
        + TRUE["per_token_s"] * step.context_tokens
        + TRUE["prefill_s_per_token"] * step.prefill_tokens
    )


def streamed_batch(n: int, prompt: int, tokens: int, block_size: int) -> list[StreamedRequest]:
    """A batch served exactly as the fake serves it: one prefill step for all, then one
    decode step per token, each taking the true step time."""
    clock = true_step(TimedStep(block_size, n, n * prompt, 0, n * prompt, 1.0))
    stamps = [clock]
    for k in range(1, tokens):
        clock += true_step(TimedStep(block_size, n, n * (prompt + k), 0, 0, 1.0))
        stamps.append(clock)
    return [StreamedRequest(0.0, tuple(stamps)) for _ in range(n)]


def test_steps_from_exact_streams_fit_the_true_coefficients():
    steps = []
    for block_size in (32, 128):
        for n in (1, 4, 16):
            for prompt in (64, 512):
                steps += timed_steps(block_size, prompt, streamed_batch(n, prompt, 25, block_size))
    fit = fit_steps(steps)
    for block_size in (32, 128):
        got = fit.coefficients[block_size]
        for term, value in TRUE.items():
            assert getattr(got, term) == pytest.approx(value, rel=0.02), term
        # the middle step stands for a segment: its features are exact up to rounding
        assert got.per_block_s == pytest.approx(0, abs=1e-7)
    assert not fit.depends_on_block_size


def test_a_batch_gives_its_prefill_and_decode_segments():
    requests = streamed_batch(4, 100, 1 + 2 * SEGMENT_TOKENS, 32)
    steps = timed_steps(32, 100, requests)
    prefill, *decode = steps
    assert (prefill.sequences, prefill.prefill_tokens, prefill.prompt_chunks) == (4, 400, 4)
    assert prefill.context_blocks == 4 * math.ceil(100 / 32)
    assert len(decode) == 2
    # the first segment computes tokens 1..8, its middle step holds 100 + 5 tokens each
    assert decode[0].context_tokens == 4 * (100 + 1 + SEGMENT_TOKENS // 2)
    assert decode[0].prefill_tokens == 0
    assert decode[0].seconds == pytest.approx(true_step(decode[0]), rel=0.01)
    # prompts beyond one step's token budget prefill in chunks: no prefill step is read
    chunked = timed_steps(32, 100, requests, max_batched_tokens=399)
    assert all(s.prefill_tokens == 0 for s in chunked)


def test_a_grid_needs_one_decode_segment():
    with pytest.raises(ValueError, match="decode_tokens must be at least"):
        VllmGrid((32,), (1,), (64,), decode_tokens=SEGMENT_TOKENS)


def test_the_model_shape_comes_from_the_folders_config(tmp_path):
    shape = hf_model_shape(model_folder(tmp_path), "smollm2", "float32")
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (30, 3, 64)
    (tmp_path / "smollm2" / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="config.json: no 'num_attention_heads'"):
        hf_model_shape(tmp_path / "smollm2", "smollm2", "float32")


@pytest.mark.slow  # starts the fake vLLM
def test_a_refused_block_size_names_vllms_error(tmp_path):
    server = VllmServer(fake_template(), 16, tmp_path / "b16.log", start_timeout_s=20)
    with pytest.raises(VllmStartError, match=r"No common block size for 16 .*b16.log"):
        server.start()
    assert "$ " in (tmp_path / "b16.log").read_text()


@pytest.mark.slow  # starts the fake vLLM
def test_calibrate_engine_vllm_recovers_the_fakes_step_coefficients(tmp_path, capsys):
    out = tmp_path / "vllm.yaml"
    code = main(
        [
            "calibrate",
            "--engine",
            "vllm",
            "--model",
            str(model_folder(tmp_path)),
            "--vllm-command",
            fake_template(**TRUE),
            "--vllm-logs",
            str(tmp_path / "logs"),
            "--block-sizes",
            "32",
            "128",
            "--batch-sizes",
            "1",
            "4",
            "--context-lens",
            "64",
            "512",
            "--decode-tokens",
            "17",
            "--out",
            str(out),
        ]
    )
    assert code == 0, capsys.readouterr().err
    calibration = load_calibration(out)
    assert calibration.provenance.device == "cpu (vLLM 0.0.0+fake)"
    assert calibration.engine.model.name == "smollm2"
    assert calibration.engine.model.num_kv_heads == 3
    assert sorted(calibration.engine.steps) == [32, 128]
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [
        "vllm-b128.log",
        "vllm-b32.log",
    ]
    # the fitted decode steps price the fake's within the noise of sleeping threads
    fitted = calibration.engine.steps[32]
    for n, context in ((1, 64), (4, 512)):
        step = TimedStep(32, n, n * context, 0, 0, 1.0, padded_tokens=n * context)
        assert predict_step_s(fitted, step) == pytest.approx(true_step(step), rel=0.4)
    # the slope per context token is the fake's
    slope = fitted.per_token_s + fitted.per_padded_token_s + fitted.per_block_s / 32
    assert slope == pytest.approx(TRUE["per_token_s"], rel=0.4)

    # and so is what a longer prompt adds to its prefill; how that splits between the
    # per-token and per-pair terms two prompt lengths do not identify, and a prefill's first
    # token also waits for the step running when it arrives (per_admission_s takes that)
    def prefill_s(prompt: int) -> float:
        pairs = prefill_pairs(0, prompt)
        return fitted.prefill_s_per_token * prompt + fitted.prefill_s_per_pair * pairs

    longer = prefill_s(512) - prefill_s(64)
    assert longer == pytest.approx(TRUE["prefill_s_per_token"] * (512 - 64), rel=0.4)


def test_calibrate_engine_vllm_refuses_flags_of_the_other_engine(tmp_path, capsys):
    code = main(
        ["calibrate", "--engine", "vllm", "--model", str(model_folder(tmp_path)), "--trace", "x"]
    )
    assert code == 2
    assert "--trace do not apply to --engine vllm" in capsys.readouterr().err


def test_calibrate_engine_vllm_without_a_venv_says_how_to_get_one(tmp_path, capsys):
    code = main(
        [
            "calibrate",
            "--engine",
            "vllm",
            "--model",
            str(model_folder(tmp_path)),
            "--vllm-venv",
            str(tmp_path / "none"),
        ]
    )
    assert code == 2
    assert "no vLLM environment (`make vllm` builds one" in capsys.readouterr().err
