"""The sidecar checks what a vLLM server reports against its policy: a block size the
policy's backend refuses or no candidate, another attention backend, another device."""

import json
import logging
import sys
from pathlib import Path

from blocktune.tuner.config.policy import Policy, load_policy
from blocktune.tuner.sidecar.sidecar import Sidecar

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
    sidecar = Sidecar(CPU_VLLM)
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
    assert sidecar.metrics()["engine_mismatches"] == {"block_size": 3, "backend": 0, "device": 0}
    # The server's log names its backend and platform (the vllm_process actuator reads it).
    sidecar._report_engine("cuda", None)
    sidecar._report_engine(None, "FLASH_ATTN")
    sidecar._report_engine(None, "CPU_ATTN")
    kinds = [(w["kind"], w["value"]) for w in mismatches(caplog)[2:]]
    assert kinds == [("backend", "FLASH_ATTN")]  # cuda and the L4 calibration agree
    sidecar._report_engine("cpu", None)
    device = mismatches(caplog)[-1]
    assert device["kind"] == "device" and "cpu (as the engine reports)" in device["warning"]
