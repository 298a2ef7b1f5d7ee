"""`validate --engine vllm` against the fake vLLM (tests/fake_vllm.py): requests sent at
their arrival times, the measured table beside the simulator's, priced by a calibration of
the fake's own step coefficients, so the two sides differ only by scheduling and the noise
of sleeping threads."""

import json
import shlex
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from blocktune.tuner.cli import main
from blocktune.tuner.config.calibration import (
    EngineCalibration,
    FitResiduals,
    Provenance,
    StepCoefficients,
    analytic_calibration,
)
from blocktune.tuner.config.policy import ModelShape

FAKE_VLLM = Path(__file__).resolve().parents[2] / "fake_vllm.py"
STEP = {"fixed_s": 0.01, "per_sequence_s": 0.002, "per_token_s": 1e-5}
SMOLLM2 = ModelShape(
    name="smollm2",
    num_layers=30,
    hidden_size=576,
    intermediate_size=1536,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    vocab_size=49152,
    dtype="float32",
)


def fake_template() -> str:
    step = ",".join(f"{k}={v}" for k, v in STEP.items())
    return (
        shlex.join([sys.executable, str(FAKE_VLLM), "--start-delay", "0.1", "--step", step])
        + " --port {port} --block-size {block_size}"
    )


def write_inputs(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A calibration of the fake's exact coefficients, a vLLM policy and a 24-request trace."""
    sizes = (32, 128)
    steps = {b: StepCoefficients(per_block_s=0.0, prefill_s_per_token=0.0, **STEP) for b in sizes}
    provenance = Provenance(
        kind="measured", device="cpu (vLLM fake)", date="2026-12-01", torch="x", grid={}
    )
    engine = EngineCalibration(
        provenance=provenance,
        model=SMOLLM2,
        threads=1,
        steps=steps,
        residuals={b: FitResiduals(points=1, rms_relative=0, max_relative=0) for b in sizes},
    )
    calibration = analytic_calibration().model_copy(update={"provenance": provenance})
    calibration_file = tmp_path / "fake.yaml"
    calibration_file.write_text(calibration.with_engine(engine).to_yaml())
    policy = {
        "deployment": "fake-vllm",
        "model": SMOLLM2.model_dump(exclude_none=True),
        "kv_budget": "1GiB",
        "engine": "vllm",
        "vllm_backend": "CPU_ATTN",
        "candidates": list(sizes),
        "calibration": str(calibration_file),
    }
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(policy))
    rng = np.random.default_rng(3)
    trace = pd.DataFrame(
        {
            "arrival_s": np.arange(24) * 0.05,
            "prompt_tokens": rng.integers(20, 300, 24),
            "output_tokens": rng.integers(8, 24, 24),
        }
    )
    trace_file = tmp_path / "trace.csv"
    trace.to_csv(trace_file, index=False)
    return calibration_file, policy_file, trace_file


@pytest.mark.slow  # starts the fake vLLM
def test_validate_engine_vllm_prints_the_table_and_matches_the_fake(tmp_path, capsys):
    calibration, policy, trace = write_inputs(tmp_path)
    args = ["validate", str(trace), "--engine", "vllm", "--policy", str(policy)]
    args += ["--calibration", str(calibration), "--vllm-command", fake_template()]
    args += ["--vllm-logs", str(tmp_path / "logs"), "--runs", "1"]
    assert main([*args, "--json", str(tmp_path / "out.json")]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "first 24 requests" in out
    assert "KV blocks per size, simulated / vLLM's: B=32: " in out
    assert "TPOT p50" in out
    result = json.loads((tmp_path / "out.json").read_text())
    assert [r["block_size"] for r in result["results"]] == [32, 128]
    for row in result["results"]:
        measured = row["measured"]
        # every token the trace asks for was streamed: tokens/s is the trace's over its span
        assert measured["tokens_per_s"] > 0
        assert measured["preemptions"] == 0
        assert measured["peak_kv_blocks"] > 0
        # the simulator, priced at the fake's own coefficients, predicts it (within what a
        # loaded machine adds to the fake's sleeps; sending every request at once instead of
        # at its arrival, or losing tokens, moves these by far more)
        for metric in ("tokens_per_s", "tpot_p50_s"):
            assert abs(row["relative_error"][metric]) < 0.5, (metric, row)
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [
        "vllm-validate-b128.log",
        "vllm-validate-b32.log",
    ]


def test_validate_engine_vllm_needs_a_calibration(tmp_path, capsys):
    _, policy, trace = write_inputs(tmp_path)
    code = main(["validate", str(trace), "--engine", "vllm", "--policy", str(policy)])
    assert code == 2
    assert "--engine vllm needs --calibration FILE" in capsys.readouterr().err


def test_validate_engine_vllm_refuses_a_calibration_of_another_model(tmp_path, capsys):
    _, policy, trace = write_inputs(tmp_path)
    other = tmp_path / "analytic.yaml"
    other.write_text(analytic_calibration().to_yaml())
    args = ["validate", str(trace), "--engine", "vllm", "--policy", str(policy)]
    args += ["--calibration", str(other), "--vllm-command", fake_template()]
    assert main(args) == 2
    assert "needs a calibration with an engine section" in capsys.readouterr().err


@pytest.mark.parametrize("missing", ["{port}", "{block_size}"])
def test_a_command_without_its_placeholders_is_refused(tmp_path, capsys, missing):
    calibration, policy, trace = write_inputs(tmp_path)
    template = fake_template().replace(missing, "1")
    args = ["validate", str(trace), "--engine", "vllm", "--policy", str(policy)]
    args += ["--calibration", str(calibration), "--vllm-command", template]
    assert main(args) == 2
    assert "must contain {block_size} and {port}" in capsys.readouterr().err
