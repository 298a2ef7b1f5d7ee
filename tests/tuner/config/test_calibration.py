"""Calibration files: the bundled analytic model, the default's preference, `calibrate` on CPU."""

import shutil
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch

from blocktune.kernels.cpu_attention import default_backend
from blocktune.tuner.cli import main
from blocktune.tuner.config.calibration import (
    ANALYTIC_FILE,
    CalibrationError,
    analytic_calibration,
    bundled_files,
    bundled_names,
    calibration_for,
    default_calibration,
    device_mismatch,
    load_calibration,
)
from blocktune.tuner.config.config_files import ConfigError
from blocktune.tuner.config.policy import Policy, load_policy
from blocktune.tuner.measure.measure import measure_host

ROOT = Path(__file__).resolve().parents[3]


def test_the_bundled_analytic_model_cites_its_constants():
    calibration = analytic_calibration()
    provenance = calibration.provenance
    assert provenance.kind == "analytic" and "analytic" in provenance.device
    assert any("PagedAttention" in source and "20-26%" in source for source in provenance.sources)
    assert calibration.block_sizes == (8, 16, 32, 64, 128, 256)
    # The cited model: bandwidth-bound reads of 4096 B per token and layer, and a 23%
    # block-table overhead at B = 16 charged per block.
    per_token = calibration.kernel_shape.kv_bytes_per_token_layer / (
        calibration.memory_bandwidth_bytes_per_s
    )
    for coefficients in calibration.kernel.values():
        assert coefficients.per_token_s == pytest.approx(per_token, rel=1e-4)
        assert coefficients.per_block_s == pytest.approx(0.23 * 16 * per_token, rel=1e-4)
    assert calibration.copy_bandwidth_bytes_per_s == calibration.memory_bandwidth_bytes_per_s / 2


@pytest.mark.parametrize(
    ("name", "bandwidth", "flops"),
    [("analytic_default", 300e9, 121e12), ("analytic_a100_80gb", 2039e9, 312e12)],
)
def test_each_bundled_device_model_derives_its_constants_from_its_datasheet(name, bandwidth, flops):
    calibration = load_calibration(bundled_names()[name])
    assert calibration.provenance.kind == "analytic"
    assert calibration.memory_bandwidth_bytes_per_s == bandwidth
    assert calibration.compute_flops_per_s == flops
    assert calibration.copy_bandwidth_bytes_per_s == bandwidth / 2
    per_token = 4096 / bandwidth  # 8 KV heads x 128 x K and V x 2 bytes, read once per step
    for coefficients in calibration.kernel.values():
        assert coefficients.per_token_s == pytest.approx(per_token, rel=1e-4)
        assert coefficients.per_block_s == pytest.approx(0.23 * 16 * per_token, rel=1e-4)


def test_a_policy_names_a_bundled_calibration_and_a_device_mismatch_is_warned(tmp_path):
    long_document = load_policy("long_document")
    calibration = calibration_for(long_document, tmp_path)
    assert calibration.provenance.device == "NVIDIA A100 80GB SXM (analytic model)"
    assert device_mismatch(long_document, calibration) is None
    # The same policy priced with the L4 model: the warning names both devices.
    l4 = calibration_for(long_document.model_copy(update={"calibration": "default"}), tmp_path)
    warning = device_mismatch(long_document, l4)
    assert "NVIDIA A100 80GB" in warning and "NVIDIA L4 (analytic model)" in warning
    # Case, spaces and punctuation do not matter; a policy that states no device is not checked.
    l4_policy = long_document.model_copy(update={"device": "nvidia-l4"})
    assert device_mismatch(l4_policy, l4) is None
    assert device_mismatch(long_document.model_copy(update={"device": None}), l4) is None
    # With no device named, the engine's says which: a CPU vLLM priced as an L4 is warned of.
    unnamed = long_document.model_copy(update={"device": None})
    assert "runs on cpu (as the engine reports)" in device_mismatch(unnamed, l4, "cpu")
    assert device_mismatch(unnamed, l4, "cuda") is None
    cpu_vllm = Policy.model_validate(
        {**unnamed.model_dump(), "engine": "vllm", "vllm_backend": "CPU_ATTN", "candidates": [32]}
    )
    warning = device_mismatch(cpu_vllm, l4)
    assert "a CPU (vLLM's CPU_ATTN backend)" in warning and "NVIDIA L4" in warning
    cpu_calibration = l4.model_copy(
        update={"provenance": l4.provenance.model_copy(update={"device": "CPU x86_64 (Linux)"})}
    )
    assert device_mismatch(cpu_vllm, cpu_calibration) is None
    assert "runs on cuda" in device_mismatch(cpu_vllm, cpu_calibration, "cuda")
    # A file of that name next to the policy wins over the bundled one.
    (tmp_path / "analytic_a100_80gb").write_text(l4.to_yaml(), encoding="utf-8")
    assert calibration_for(long_document, tmp_path) == l4


def test_policy_check_prints_a_device_mismatch_and_still_passes(tmp_path, capsys):
    text = (ROOT / "policies" / "customer_service_llama8b.yaml").read_text(encoding="utf-8")
    path = tmp_path / "h100.yaml"
    path.write_text(text.replace("device: NVIDIA L4", "device: NVIDIA H100"), encoding="utf-8")
    assert main(["policy", "check", str(path)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith(f"{path}: warning: the policy runs on NVIDIA H100")
    assert printed[1] == f"{path}: ok"


def test_the_default_prefers_the_newest_measured_file(tmp_path):
    analytic = analytic_calibration()
    shutil.copy(next(p for p in bundled_files() if p.name == ANALYTIC_FILE), tmp_path)
    assert default_calibration(tmp_path) == analytic
    for day in (3, 9):
        measured = analytic.model_copy(
            update={
                "provenance": analytic.provenance.model_copy(
                    update={
                        "kind": "measured",
                        "device": f"gpu measured on day {day}",
                        "date": datetime(2027, 1, day, tzinfo=timezone.utc),
                        "torch": "2.13",
                        "grid": {"block_sizes": [8, 16]},
                    }
                )
            }
        )
        (tmp_path / f"measured_{day}.yaml").write_text(measured.to_yaml(), encoding="utf-8")
    assert default_calibration(tmp_path).provenance.device == "gpu measured on day 9"
    with pytest.raises(ConfigError, match="no measured calibration"):
        default_calibration(tmp_path / "empty")


def test_yaml_round_trip_and_validation(tmp_path):
    calibration = analytic_calibration()
    path = tmp_path / "copy.yaml"
    path.write_text(calibration.to_yaml(), encoding="utf-8")
    assert load_calibration(path) == calibration
    broken = calibration.to_yaml().replace("per_block_s: 5.0244e-08", "per_block_s: -1", 1)
    broken = broken.replace("  256: 1.0e-06\n", "")
    path.write_text(broken, encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_calibration(path)
    problems = caught.value.problems
    assert any(
        ": kernel[8].per_block_s: Input should be greater than or equal to 0" in p for p in problems
    )
    # The model check runs once the fields are valid: fix the sign and see the coverage error.
    path.write_text(broken.replace("per_block_s: -1", "per_block_s: 5.0e-08"), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"host_s_per_token covers \[8, 16, 32, 64, 128\]"):
        load_calibration(path)


def test_uncovered_block_sizes_are_named():
    with pytest.raises(CalibrationError, match=r"block sizes \[4, 512\]"):
        analytic_calibration().require([4, 8, 512])


def test_host_bookkeeping_is_measured_per_generated_token():
    seconds = measure_host(16, requests=60, concurrency=8)
    assert 1e-8 < seconds < 1e-3


def test_calibrate_on_cpu_writes_a_measured_file(tmp_path, capsys):
    out = tmp_path / "cpu.yaml"
    assert main(["calibrate", "--device", "cpu", "--quick", "--block-sizes", "8", "32"]) == 0
    printed = capsys.readouterr().out
    assert (
        main(
            [
                "calibrate",
                "--device",
                "cpu",
                "--quick",
                "--block-sizes",
                "8",
                "32",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert "kind: measured" in printed
    calibration = load_calibration(out)
    provenance = calibration.provenance
    assert provenance.kind == "measured" and provenance.backend == default_backend("cpu")
    assert provenance.torch == torch.__version__
    assert provenance.grid["block_sizes"] == [8, 32] and provenance.grid["context_lens"]
    assert calibration.block_sizes == (8, 32)
    assert all(value > 0 for value in calibration.host_s_per_token.values())
    assert calibration.copy_bandwidth_bytes_per_s > 0
    assert calibration.compute_flops_per_s > 0
    # Every kernel fit explains a positive time for a real context.
    for coefficients in calibration.kernel.values():
        time_1000 = (
            coefficients.launch_s + coefficients.per_block_s * 32 + coefficients.per_token_s * 1000
        )
        assert time_1000 > 0


ENGINE_SECTION = """\
engine:
  provenance: {kind: measured, device: cpu, date: '2026-12-01T00:00:00Z', torch: '2.5', grid: {}}
  model:
    name: smollm2
    num_layers: 30
    hidden_size: 576
    intermediate_size: 1536
    num_heads: 9
    num_kv_heads: 3
    head_dim: 64
    vocab_size: 49152
    dtype: float32
  threads: 1
  steps:
    16: {fixed_s: 0.01, per_block_s: 0.0, per_token_s: 1.0e-05, per_sequence_s: 0.002,
         prefill_s_per_token: 1.0e-05}
  residuals:
    16: {points: 10, rms_relative: 0.01, max_relative: 0.02}
"""
"""An engine section as calibrations wrote it before the model recorded its weight count."""


def test_an_engine_section_without_the_weight_count_loads_and_counts_it(tmp_path):
    path = tmp_path / "engine.yaml"
    path.write_text(analytic_calibration().to_yaml() + ENGINE_SECTION, encoding="utf-8")
    calibration = load_calibration(path)
    model = calibration.engine.model
    assert (model.name, model.vocab_size, model.num_params) == ("smollm2", 49152, None)
    assert model.weight_count == 134_479_872  # SmolLM2-135M, its embeddings tied
    assert "num_params" not in calibration.to_yaml()
    path.write_text(calibration.to_yaml(), encoding="utf-8")
    assert load_calibration(path) == calibration
    policy = Policy(deployment="smol", model=model, kv_budget="64MiB", candidates=(16,))
    calibration.engine.require_model(policy.model)  # the timed model is the policy's
    other = model.model_copy(update={"num_kv_heads": 9, "dtype": "bfloat16"})
    with pytest.raises(CalibrationError, match=r"num_kv_heads 9 \(measured: 3\), dtype bf"):
        calibration.engine.require_model(other)


def test_an_engine_section_needs_the_timed_models_name_and_vocabulary(tmp_path):
    path = tmp_path / "engine.yaml"
    nameless = ENGINE_SECTION.replace("    name: smollm2\n", "")
    path.write_text(analytic_calibration().to_yaml() + nameless, encoding="utf-8")
    with pytest.raises(ConfigError, match="the timed model's name and vocab_size are needed"):
        load_calibration(path)


def test_every_bundled_calibration_loads():
    files = bundled_files()
    assert {path.name for path in files} >= {ANALYTIC_FILE}
    for path in files:
        assert load_calibration(path).block_sizes
