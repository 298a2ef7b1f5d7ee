"""The sidecar checks what a vLLM server reports against its policy: a block size the
policy's backend refuses or no candidate, another attention backend, another device.
It decides as soon as its window first holds min_samples requests."""

import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

from blocktune.tuner.config.policy import Policy, load_policy
from blocktune.tuner.sidecar.assembly import build_sidecar

POLICY = load_policy(Path(__file__).resolve().parents[3] / "policies" / "default.yaml")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fake_vllm import metrics_text  # noqa: E402

CPU_VLLM = Policy.model_validate(
    {
        **load_policy().model_dump(),
        "engine": "vllm",
        "vllm_backend": "CPU_ATTN",
        "candidates": [32, 64, 128],
        "sources": {"push": False, "vllm_metrics": {"url": "http://127.0.0.1:9/metrics"}},
    }
)


def mismatches(caplog) -> list[dict]:
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "blocktune.sidecar"]
    return [line for line in lines if line["event"] == "engine_mismatch"]


def test_a_reported_size_backend_or_platform_at_odds_with_the_policy_is_warned_once(caplog):
    caplog.set_level(logging.INFO, logger="blocktune.sidecar")
    sidecar = build_sidecar(CPU_VLLM)
    source = sidecar.sources[0]
    for _ in range(2):
        source.ingest(metrics_text(16, 0))
    assert sidecar.current_block_size == 16
    source.ingest(metrics_text(256, 0))
    source.ingest(metrics_text(64, 0))
    warned = mismatches(caplog)
    assert [(w["kind"], w["value"]) for w in warned] == [("block_size", 16), ("block_size", 256)]
    assert "multiples of 32" in warned[0]["warning"] and "cpu_attn.py" in warned[0]["warning"]
    assert "not among the policy's candidates [32, 64, 128]" in warned[1]["warning"]
    assert sidecar.stats().engine_mismatches == {"block_size": 3, "backend": 0, "device": 0}
    # The server's log names its backend and platform (the vllm_process actuator reads it).
    sidecar.report_engine("cuda", None)
    sidecar.report_engine(None, "FLASH_ATTN")
    sidecar.report_engine(None, "CPU_ATTN")
    kinds = [(w["kind"], w["value"]) for w in mismatches(caplog)[2:]]
    assert kinds == [("backend", "FLASH_ATTN")]  # cuda and the L4 calibration agree
    sidecar.report_engine("cpu", None)
    device = mismatches(caplog)[-1]
    assert device["kind"] == "device" and "cpu (as the engine reports)" in device["warning"]


def observations(count: int) -> list[dict]:
    rng = np.random.default_rng(0)
    return [
        {"prompt_tokens": int(p), "output_tokens": int(o), "timestamp": 1.7e9 + 0.2 * i}
        for i, (p, o) in enumerate(
            zip(rng.integers(60, 90, count), rng.integers(20, 60, count), strict=True)
        )
    ]


def test_the_first_decision_comes_at_min_samples_not_an_interval_later():
    """A 5-minute interval: below min_samples nothing is decided; the push that brings the
    window to min_samples starts a decision at once, and the next one is an interval later."""
    sidecar = build_sidecar(POLICY)
    sidecar.start()
    try:
        below = POLICY.window.min_samples - 1
        sidecar.push(observations(below))
        time.sleep(0.2)
        assert sidecar.scheduler.runs == 0
        assert sidecar.recommendation()["reason"] == "no decision yet"
        sidecar.push(observations(1))
        deadline = time.monotonic() + 30
        while sidecar.scheduler.runs == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sidecar.scheduler.runs == 1
        body = sidecar.recommendation()
        assert body["samples"] == POLICY.window.min_samples and "gain_interval" in body
        interval = POLICY.interval.total_seconds()
        assert body["next_run_at"] - body["decided_at"] >= interval - 5
    finally:
        sidecar.stop()
