"""`blocktune recommend` on the synthetic day and, when present, the Azure conversation trace."""

import json
from pathlib import Path

import pytest

from blocktune.traces.synth import customer_service_day
from blocktune.tuner.cli import main
from blocktune.tuner.config.calibration import analytic_calibration
from blocktune.tuner.config.policy import load_policy
from blocktune.tuner.core.recommendation import recommend

ROOT = Path(__file__).resolve().parents[3]
AZURE = ROOT.parent / "shared" / "traces" / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"


@pytest.fixture(scope="module")
def policy_file(analytic_policy_file) -> str:
    return analytic_policy_file("default")


def run_json(capsys, policy_file: str, *args: str) -> dict:
    assert main(["recommend", *args, "--policy", policy_file, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_for_the_synthetic_promotion_burst(capsys, policy_file):
    report = run_json(capsys, policy_file, "synthetic", "--phase", "promo", "--last", "1000")
    assert {"block_size", "prior_block_size", "candidates", "window"} <= set(report)
    sizes = [c["block_size"] for c in report["candidates"]]
    assert sizes == [8, 16, 32, 64, 128]
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
    decision, _, left_out = recommend(frame, policy, analytic_calibration())
    assert left_out == 0 and not decision.material
    assert "recommended: B=16 (no other size is better beyond the forecast's noise" in out
    rows = [line for line in out.splitlines() if line[:6].strip().lstrip("* ").isdigit()]
    sizes = [int(row.strip("* ").split()[0]) for row in rows]
    assert sizes == list(policy.candidates) * 2  # predicted service, then cost terms
    assert sum(row.startswith("*") for row in rows) == 2
    assert "article's rule" in out and "prior: B*" in out


def test_a_light_customer_service_trace_keeps_16_and_says_it_does_not_matter(capsys, policy_file):
    report = run_json(capsys, policy_file, "synthetic", "--phase", "day", "--last", "1000")
    assert report["material"] is False and report["recommended_block_size"] == 16
    assert report["reason"].startswith("at this load every candidate is within 2% of B=16")
    for row in report["candidates"]:
        assert row["tokens_per_s"] > 0 and row["ttft_p99_s"] > 0 and row["tpot_p99_s"] > 0
        assert row["capacity"] > 1


def test_a_calibration_for_another_device_is_warned_about(capsys, tmp_path, policy_file):
    text = Path(policy_file).read_text(encoding="utf-8")
    path = tmp_path / "h100.yaml"
    path.write_text(text.replace("device: NVIDIA L4", "device: NVIDIA H100"), encoding="utf-8")
    assert run_json(capsys, policy_file, "synthetic", "--last", "300")["warnings"] == []
    report = run_json(capsys, str(path), "synthetic", "--last", "300")
    [warning] = report["warnings"]
    assert warning.startswith("the policy runs on NVIDIA H100 but its calibration is for NVIDIA L4")
    assert main(["recommend", "synthetic", "--last", "300", "--policy", str(path)]) == 0
    assert f"warning: {warning}" in capsys.readouterr().out.splitlines()


def test_requests_that_can_never_fit_are_left_out_and_counted(capsys, tmp_path, policy_file):
    trace = tmp_path / "mixed.csv"
    rows = [f"{i},{30 + i % 7},{10}" for i in range(150)] + ["151,40000,10"]
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n" + "\n".join(rows) + "\n")
    report = run_json(capsys, policy_file, str(trace))
    assert report["left_out_longer_than_the_pool"] == 1
    assert report["window"]["count"] == 150
    assert main(["recommend", str(trace), "--policy", policy_file]) == 0
    assert "left out 1 requests longer than the KV pool" in capsys.readouterr().out


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
    # The 4 GiB pool cannot serve the hour at its own load: every size has a capacity below 1,
    # and the larger blocks' cheaper block-table work serves more of it.
    capacity = {b: c["capacity"] for b, c in costs.items()}
    assert max(capacity.values()) < 1
    # Overloaded: the sizes are ranked by what they still serve, their saturated token rate
    # (larger blocks a few percent more, as the replay's static runs serve 1.7% more at 64).
    assert report["ranked_by"] == "sustained tokens/s"
    # (0.15x the hour's own rate; its last 128 requests, the forecast's sample, arrive slower)
    assert report["reason"].startswith("overloaded (B=16 serves 0.15x the observed load")
    served = {b: c["sustained_tokens_per_s"] for b, c in costs.items()}
    assert max(served, key=served.get) in (32, 64) and served[16] < max(served.values())
    low, high = report["gain_interval"]
    assert low <= report["gain"] <= high and low < high  # resamples may tie the sample's gain
    assert report["material"] is (low > 0.02)
    for cost in costs.values():
        assert cost["capacity_interval"][0] <= cost["capacity"] <= cost["capacity_interval"][1]
