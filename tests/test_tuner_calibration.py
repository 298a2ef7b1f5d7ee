"""Calibration files: the bundled analytic model, the default's preference, `calibrate` on CPU."""

import shutil
import time
from datetime import datetime, timezone

import pytest
import torch

from blocktune.tuner.cli import main
from blocktune.tuner.core.calibration import (
    ANALYTIC_FILE,
    CalibrationError,
    analytic_calibration,
    bundled_files,
    default_calibration,
    load_calibration,
)
from blocktune.tuner.core.config_files import ConfigError
from blocktune.tuner.core.measure import measure_host


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
    begin = time.perf_counter()
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
    assert time.perf_counter() - begin < 30
    assert "kind: measured" in printed
    calibration = load_calibration(out)
    provenance = calibration.provenance
    assert provenance.kind == "measured" and provenance.backend == "torch"
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
