"""`blocktune recommend` on the synthetic day and, when present, the Azure conversation trace."""

import json
from pathlib import Path

import pytest

from blocktune.traces.synth import customer_service_day
from blocktune.tuner.cli import main
from blocktune.tuner.core.calibration import ANALYTIC_FILE, analytic_calibration, bundled_files
from blocktune.tuner.core.policy import load_policy
from blocktune.tuner.core.recommendation import recommend

ROOT = Path(__file__).resolve().parents[1]
AZURE = ROOT.parent / "shared" / "traces" / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"


@pytest.fixture(scope="module")
def policy_file(tmp_path_factory) -> str:
    """policies/default.yaml pinned to the bundled analytic calibration (a measured file
    bundled later must not change what these tests expect)."""
    analytic = next(p for p in bundled_files() if p.name == ANALYTIC_FILE)
    text = (ROOT / "policies" / "default.yaml").read_text(encoding="utf-8")
    pinned = text.replace("calibration: default", f"calibration: {analytic}")
    assert pinned != text
    path = tmp_path_factory.mktemp("policy") / "default_analytic.yaml"
    path.write_text(pinned, encoding="utf-8")
    return str(path)


def run_json(capsys, policy_file: str, *args: str) -> dict:
    assert main(["recommend", *args, "--policy", policy_file, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_for_the_synthetic_promotion_burst(capsys, policy_file):
    report = run_json(capsys, policy_file, "synthetic", "--phase", "promo", "--last", "1000")
    assert {"block_size", "prior_block_size", "candidates", "window"} <= set(report)
    sizes = [c["block_size"] for c in report["candidates"]]
    assert sizes == [8, 16, 32, 64, 128]
    objectives = {c["block_size"]: c["objective_s_per_token"] for c in report["candidates"]}
    assert report["block_size"] == min(objectives, key=objectives.get)
    window = report["window"]
    assert window["count"] == 1000
    assert sum(b["count"] for b in window["histogram"]) == 1000
    promo = customer_service_day(0).query("phase == 'promo'").tail(1000)
    median = (promo.prompt_tokens + promo.output_tokens).median()
    assert window["total_tokens"]["median"] == pytest.approx(median)
    first = report["candidates"][0]
    assert first["kernel_s_per_token"] == pytest.approx(
        first["kernel_translation_s_per_token"] + first["kernel_bandwidth_s_per_token"]
    )


def test_the_whole_synthetic_day_carries_prefix_groups(capsys, policy_file):
    report = run_json(capsys, policy_file, "synthetic")
    day = customer_service_day(0)
    grouped = day.prefix_group.dropna()
    shared = len(grouped) - grouped.nunique()
    assert report["window"]["count"] == len(day)
    for cost in report["candidates"]:
        assert cost["prefix_loss_tokens"] == pytest.approx(shared * (cost["block_size"] - 1) / 2)


def test_table_lists_every_candidate_and_the_choice(capsys, policy_file):
    assert main(["recommend", "synthetic", "--phase", "day", "--policy", policy_file]) == 0
    out = capsys.readouterr().out
    policy = load_policy(policy_file)
    frame = customer_service_day(0).query("phase == 'day'")
    decision, _ = recommend(frame, policy, analytic_calibration())
    assert f"choice: B={decision.block_size}" in out
    rows = [line for line in out.splitlines() if line[:6].strip().lstrip("* ").isdigit()]
    assert [int(row[:6].strip(" *")) for row in rows] == list(policy.candidates)
    assert sum(row.startswith("*") for row in rows) == 1
    assert "article's rule" in out and "prior: B*" in out


def test_bad_requests_exit_2_with_a_message(capsys, tmp_path, policy_file):
    assert main(["recommend", "synthetic", "--phase", "lunch", "--policy", policy_file]) == 2
    assert "no phase 'lunch'" in capsys.readouterr().err
    missing = str(tmp_path / "missing.yaml")
    assert main(["recommend", "synthetic", "--policy", missing]) == 2
    assert "missing.yaml: cannot read" in capsys.readouterr().err
    assert main(["recommend", str(tmp_path / "none.csv"), "--policy", policy_file]) == 2
    assert "none.csv" in capsys.readouterr().err


@pytest.mark.skipif(not AZURE.exists(), reason="the shared Azure trace is not present")
def test_recommend_on_the_azure_conversation_trace(capsys, policy_file):
    report = run_json(capsys, policy_file, str(AZURE), "--format", "azure")
    assert report["window"]["count"] > 19_000
    costs = {c["block_size"]: c for c in report["candidates"]}
    # Long prompts: padding is small at every size, so block-table work decides.
    assert costs[16]["padding_ratio"] < 0.01
    assert report["block_size"] > 16
    assert report["block_size"] == min(costs, key=lambda b: costs[b]["objective_s_per_token"])
