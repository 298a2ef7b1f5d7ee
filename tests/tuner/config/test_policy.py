"""Policy files: units, every error with its file, line and key path, unknown keys, the CLI."""

from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import yaml
from pydantic import ValidationError

from blocktune.tuner.cli import main
from blocktune.tuner.config import config_files
from blocktune.tuner.config.config_files import MAX_PROBLEMS, ConfigError
from blocktune.tuner.config.policy import Policy, load_policy, parse_duration

POLICIES = Path(__file__).resolve().parents[3] / "policies"

GOOD = """\
deployment: test
model:
  num_layers: 32
  num_heads: 32
  num_kv_heads: 8
  head_dim: 128
  dtype: bfloat16
  num_params: 8.03e9
kv_budget: 40GiB
"""


def write(tmp_path: Path, text: str, name: str = "policy.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_bundled_policies_load():
    for name in ("default.yaml", "customer_service_llama8b.yaml", "long_document.yaml"):
        policy = load_policy(POLICIES / name)
        assert policy.model.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    default = load_policy(POLICIES / "default.yaml")
    assert default.kv_budget == 4 * 2**30
    assert default.candidates == (8, 16, 32, 64, 128)
    assert default.interval == timedelta(minutes=5)
    assert default.window.capacity == 1000 and default.calibration == "default"


def test_defaults_and_units(tmp_path):
    policy = load_policy(write(tmp_path, GOOD))
    assert policy.kv_budget == 40 * 2**30
    assert policy.candidates == (8, 16, 32, 64, 128)
    assert policy.window.capacity == 1000
    assert policy.interval.total_seconds() == 300
    assert policy.mode == "recommend" and policy.calibration == "default"
    assert policy.model.weight_bytes == pytest.approx(8.03e9 * 2)
    extra = GOOD.replace("kv_budget: 40GiB", "kv_budget: 40GB") + (
        "candidates: [64, 16, 32]\ninterval: 1h30m\nmin_dwell: 250ms\nsafety_factor: 1.5\n"
    )
    policy = load_policy(write(tmp_path, extra))
    assert policy.kv_budget == 40 * 10**9
    assert policy.candidates == (16, 32, 64)
    assert policy.interval.total_seconds() == 5400
    assert policy.min_dwell.total_seconds() == pytest.approx(0.25)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("5m", 300), ("30s", 30), ("1h30m", 5400), ("2d", 172800), ("0.5s", 0.5), (90, 90)],
)
def test_durations(text, seconds):
    assert parse_duration(text).total_seconds() == pytest.approx(seconds)


def test_every_bad_field_is_reported_with_file_line_and_path(tmp_path):
    text = """\
deployment: test
model:
  num_layers: 32
  num_kv_heads: 8
  head_dim: -4
  dtype: int4
  num_params: 8.03e9
kv_budget: 40 parsecs
candidates: [8, 12, 16]
window:
  capacity: 0
interval: 5 minutes
mode: auto
"""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_policy(path)
    problems = caught.value.problems
    expected = {
        "model.num_heads": 2,  # missing: reported at its mapping
        "model.head_dim": 5,
        "model.dtype": 6,
        "kv_budget": 8,
        "candidates[1]": 9,
        "window.capacity": 11,
        "interval": 12,
        "mode": 13,
    }
    assert len(problems) == len(expected)
    for key, line in expected.items():
        matching = [p for p in problems if f": {key}: " in p]
        assert len(matching) == 1, (key, problems)
        assert matching[0].startswith(f"{path}:{line}: ")
    assert "powers of two, got 12" in next(p for p in problems if "candidates[1]" in p)
    assert "'5 minutes'" in next(p for p in problems if ": interval: " in p)


def test_unknown_keys_are_rejected_wherever_they_are(tmp_path):
    text = GOOD + "window:\n  capacity: 100\n  size: 5\nbogus: [a]\n"
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_policy(path)
    problems = caught.value.problems
    assert any(p.startswith(f"{path}:12: window.size: Extra inputs") for p in problems)
    assert any(p.startswith(f"{path}:13: bogus: Extra inputs") for p in problems)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("num_kv_heads: 8", "num_kv_heads: 5"), "multiple of num_kv_heads"),
        (("kv_budget: 40GiB", "kv_budget: 1MiB"), "holds no block"),
        (("kv_budget: 40GiB", "kv_budget: 40GiB\nwindow: {capacity: 10, min_samples: 20}"), "20"),
        (("kv_budget: 40GiB", "kv_budget: 40GiB\ncandidates: [16, 16]"), "listed twice"),
        (("kv_budget: 40GiB", "kv_budget: 40GiB\ninterval: 0s"), "longer than zero"),
    ],
)
def test_cross_field_checks(tmp_path, change, message):
    with pytest.raises(ConfigError, match=message):
        load_policy(write(tmp_path, GOOD.replace(*change)))


@pytest.mark.parametrize(
    ("text", "message"),
    [("", "got empty"), ("- a\n- b\n", "got a list"), ("deployment: [unclosed\n", ":2: not valid")],
)
def test_files_that_are_not_a_mapping(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_policy(write(tmp_path, text))


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml: cannot read"):
        load_policy(tmp_path / "nope.yaml")


def test_policies_are_frozen(tmp_path):
    policy = load_policy(write(tmp_path, GOOD))
    with pytest.raises(ValidationError):
        policy.kv_budget = 1


def test_policy_check_command(tmp_path, capsys):
    assert main(["policy", "check", str(POLICIES / "default.yaml")]) == 0
    assert capsys.readouterr().out.strip().endswith("default.yaml: ok")
    bad = write(tmp_path, GOOD.replace("dtype: bfloat16", "dtype: int4") + "mode: auto\n")
    uncovered = write(
        tmp_path, GOOD + "candidates: [4, 8]\n", name="uncovered.yaml"
    )  # the default calibration starts at 8
    assert main(["policy", "check", str(bad), str(uncovered)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert [line.split(": ")[1] for line in out] == ["model.dtype", "mode", "candidates"]
    assert "block sizes [4]" in out[2]


def test_policy_check_cuts_every_echoed_value(tmp_path, capsys):
    huge = "x" * 5_000_000
    text = (
        GOOD.replace("dtype: bfloat16", f"dtype: {huge}")
        + f"unknown_key: {huge}\n"
        + f"{'k' * 1000}: 1\n"
        + f"interval: {huge}\n"
    )
    assert main(["policy", "check", str(write(tmp_path, text))]) == 1
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4 and all(len(line) < 700 for line in out), [len(line) for line in out]
    by_key = {line.split(": ")[1]: line for line in out}
    assert by_key["unknown_key"].endswith(f"(got '{'x' * 79}… (4999922 more))")
    assert (
        "model.dtype: Input should be 'float32', 'float16', 'bfloat16' or 'float8'"
        in (by_key["model.dtype"])
    )
    assert f"{'k' * 80}… (920 more)" in by_key
    assert "interval: expected a duration" in by_key["interval"] and "more)" in by_key["interval"]


def test_bundled_policies_are_found_by_name_from_any_directory(tmp_path, monkeypatch):
    from blocktune.tuner.config.policy import bundled_policies, policy_path

    monkeypatch.chdir(tmp_path)
    assert set(bundled_policies()) == {
        "default",
        "long_document",
        "customer_service_llama8b",
        "customer_service_shared_gpu",
    }
    assert load_policy().deployment == load_policy(POLICIES / "default.yaml").deployment
    named = load_policy("customer_service_llama8b")
    assert named == load_policy(POLICIES / "customer_service_llama8b.yaml")
    assert policy_path("long_document.yaml") == POLICIES / "long_document.yaml"
    # A file in the working directory wins over a bundled policy of the same name.
    (tmp_path / "default.yaml").write_text(
        (POLICIES / "default.yaml").read_text().replace("deployment: ", "deployment: local-")
    )
    assert load_policy("default.yaml").deployment.startswith("local-")
    with pytest.raises(ConfigError, match="no bundled policy of that name .*default"):
        load_policy("nope")


def test_serving_settings_default_by_engine_and_vllm_refuses_sizes_its_backend_cannot_take():
    default = load_policy()
    assert (default.goal, default.headroom, default.min_gain) == ("capacity", 2.0, 0.02)
    assert (default.slo.ttft_p99_s, default.slo.tpot_p99_s) == (2.0, 0.15)
    assert default.switch_cost_s == pytest.approx(0.01)
    data = {**default.model_dump(), "engine": "vllm"}
    flash = r"candidates \[8\] are refused by the FLASH_ATTN backend: .* of 16 .*flash_attn.py"
    with pytest.raises(ValidationError, match=flash):
        Policy.model_validate(data)
    vllm = Policy.model_validate({**data, "candidates": [16, 32, 64]})
    assert vllm.vllm_backend == "FLASH_ATTN" and vllm.backend.device == "gpu"
    assert vllm.switch_cost_s == 60.0
    # vLLM's CPU build refuses 16 (it failed after the model loaded); FlashInfer takes 16.
    cpu = r"candidates \[16\] are refused by the CPU_ATTN backend: .* multiples of 32 .*cpu_attn.py"
    with pytest.raises(ValidationError, match=cpu):
        Policy.model_validate({**data, "candidates": [16, 32, 64], "vllm_backend": "CPU_ATTN"})
    on_cpu = Policy.model_validate({**data, "candidates": [32, 128], "vllm_backend": "CPU_ATTN"})
    assert on_cpu.backend.accepts(96) and not on_cpu.backend.accepts(48)
    flashinfer = {**data, "candidates": [16, 128], "vllm_backend": "FLASHINFER"}
    assert Policy.model_validate(flashinfer).backend.refused((8, 16, 128)) == [8]
    with pytest.raises(ValidationError, match="vllm_backend\n  Input should be 'CPU_ATTN'"):
        Policy.model_validate({**data, "candidates": [32], "vllm_backend": "cpu"})


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (GOOD.encode("utf-16"), "not UTF-8 text (byte 0 is 0xff); save it as UTF-8"),
        (np.random.default_rng(0).bytes(300), "not UTF-8 text"),
        ((GOOD + "extra: " + "[" * 20_000).encode(), ":10: not valid YAML: "),
        ((GOOD + "interval: 99999999999999999999d\n").encode(), ":10: interval: durations are at"),
        ((GOOD + "interval: .inf\n").encode(), ":10: interval: durations are at most 365 days"),
    ],
)
def test_unreadable_text_deep_nesting_and_huge_durations_are_one_problem(
    tmp_path, content, message
):
    path = tmp_path / "policy.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as caught:
        load_policy(path)
    assert len(caught.value.problems) == 1 and message in caught.value.problems[0]


def test_nesting_too_deep_for_the_python_parser_is_one_problem(tmp_path, monkeypatch):
    monkeypatch.setattr(config_files, "_Loader", yaml.SafeLoader)  # no libyaml depth limit
    path = write(tmp_path, GOOD + "extra: " + "[" * 20_000 + "]" * 20_000 + "\n")
    with pytest.raises(ConfigError) as caught:
        load_policy(path)
    assert caught.value.problems == (f"{path}: nested too deeply to read",)


def test_a_repeated_key_is_reported_with_both_lines_and_errors_point_at_the_last(tmp_path):
    path = write(tmp_path, GOOD + "window:\n  capacity: 100\nwindow:\n  capacity: 0\n")
    with pytest.raises(ConfigError) as caught:
        load_policy(path)
    assert caught.value.problems == (
        f"{path}:12: window: the key appears twice (also at line 10); keep one",
        f"{path}:13: window.capacity: Input should be greater than 0 (got 0)",
    )


def test_problems_are_capped_and_each_names_its_own_line(tmp_path):
    path = write(tmp_path, GOOD + "".join(f"unknown_{i}: {i}\n" for i in range(5000)))
    with pytest.raises(ConfigError) as caught:
        load_policy(path)
    problems = caught.value.problems
    assert len(problems) == MAX_PROBLEMS + 1
    assert problems[-1] == f"{path}: ... and {5000 - MAX_PROBLEMS} more"
    for i, problem in enumerate(problems[:-1]):
        assert problem == f"{path}:{10 + i}: unknown_{i}: Extra inputs are not permitted (got {i})"


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ("window: {capacity: 100000000000}", "window.capacity"),
        ("kv_budget: 2PiB", "kv_budget"),
        ("candidates: [8, 1180591620717411303424]", "candidates[1]"),
        ("safety_factor: .inf", "safety_factor"),
    ],
)
def test_every_size_has_an_upper_bound(tmp_path, extra, key):
    text = GOOD.replace("kv_budget: 40GiB\n", "") if extra.startswith("kv_budget") else GOOD
    with pytest.raises(ConfigError) as caught:
        load_policy(write(tmp_path, text + extra + "\n"))
    assert [p.split(": ")[1] for p in caught.value.problems] == [key]
    assert "less than or equal to" in caught.value.problems[0]


def test_model_shape_sizes_have_upper_bounds(tmp_path):
    text = GOOD.replace("head_dim: 128", "head_dim: 1000000000").replace("8.03e9", "1e300")
    with pytest.raises(ConfigError) as caught:
        load_policy(write(tmp_path, text))
    assert [p.split(": ")[1] for p in caught.value.problems] == [
        "model.head_dim",
        "model.num_params",
    ]


def test_a_model_gives_its_weight_count_or_the_architecture_it_follows_from(tmp_path):
    """SmolLM2-135M's shape (tied embeddings): 49152 x 576 embeddings and 30 layers of
    576 x 64 x (2 x 9 + 2 x 3) attention and 3 x 576 x 1536 MLP weights, 134.5M."""
    smollm2 = GOOD.replace("  num_params: 8.03e9\n", "").replace("num_layers: 32", "num_layers: 30")
    smollm2 = smollm2.replace("num_heads: 32", "num_heads: 9").replace(
        "num_kv_heads: 8", "num_kv_heads: 3"
    )
    smollm2 = smollm2.replace("head_dim: 128", "head_dim: 64")
    with pytest.raises(ConfigError, match="num_params is needed where hidden_size"):
        load_policy(write(tmp_path, smollm2))
    architecture = "  hidden_size: 576\n  intermediate_size: 1536\n  vocab_size: 49152\n"
    shape = load_policy(write(tmp_path, smollm2.replace("kv_budget", architecture + "kv_budget")))
    assert shape.model.num_params is None
    assert shape.model.weight_count == 134_479_872
    assert shape.model.weight_bytes == 134_479_872 * 2  # bfloat16
    given = load_policy(write(tmp_path, GOOD.replace("kv_budget", architecture + "kv_budget")))
    assert given.model.weight_count == 8.03e9  # a count given wins over the architecture


def test_the_dtypes_priced_are_the_engines_and_vllms_fp8_cache(tmp_path):
    from blocktune.runtime.defaults import ENGINE_DTYPES
    from blocktune.tuner.config.policy import DTYPE_BYTES

    assert tuple(DTYPE_BYTES) == (*ENGINE_DTYPES, "float8")
    fp8 = load_policy(write(tmp_path, GOOD.replace("dtype: bfloat16", "dtype: float8")))
    assert fp8.model.kv_bytes_per_token == 2 * 32 * 8 * 128 * 1
    with pytest.raises(ConfigError, match="'float32', 'float16', 'bfloat16' or 'float8'"):
        load_policy(write(tmp_path, GOOD.replace("dtype: bfloat16", "dtype: int8")))
