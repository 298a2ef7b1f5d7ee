"""/metrics: vLLM's V1 metrics under vLLM's names, labels and buckets, beside blocktune's own,
counting what was served."""

import math
import re
import shutil
import subprocess

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from blocktune.runtime.config import EngineConfig
from blocktune.runtime.engine import Engine
from blocktune.runtime.engine_loop import EngineLoop
from blocktune.runtime.loading import load_pretrained
from blocktune.tuner.serving.worker_app import LengthPusher, create_worker_app

MODEL = "tiny-random"
MAX_MODEL_LEN = 2048
# promtool's lint: abbreviated units and non-base units are refused in names.
ABBREVIATED = re.compile(r"_(s|ms|us|ns|sec|b|kb|mb|gb|m|h|d|percent)(_|$)")

# Taken from vLLM's source (vllm/v1/metrics/loggers.py, PrometheusStatLogger): family name
# (as the parser reports it, without `_total`), type, labels, finite bucket bounds.
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5]
TTFT += [10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5]
ITL += [10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0]
REQUEST_LATENCY += [60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
LENGTHS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]  # build_1_2_5_buckets(2048)
ENGINE_LABELS = {"model_name", "engine"}
VLLM_METRICS = {
    "vllm:num_requests_running": ("gauge", ENGINE_LABELS, None),
    "vllm:num_requests_waiting": ("gauge", ENGINE_LABELS, None),
    "vllm:kv_cache_usage_perc": ("gauge", ENGINE_LABELS, None),
    "vllm:cache_config_info": ("gauge", {"block_size", "engine"}, None),
    "vllm:num_preemptions": ("counter", ENGINE_LABELS, None),
    "vllm:prompt_tokens": ("counter", ENGINE_LABELS, None),
    "vllm:generation_tokens": ("counter", ENGINE_LABELS, None),
    "vllm:request_success": ("counter", ENGINE_LABELS | {"finished_reason"}, None),
    "vllm:request_prompt_tokens": ("histogram", ENGINE_LABELS, LENGTHS),
    "vllm:request_generation_tokens": ("histogram", ENGINE_LABELS, LENGTHS),
    "vllm:request_params_max_tokens": ("histogram", ENGINE_LABELS, LENGTHS),
    "vllm:time_to_first_token_seconds": ("histogram", ENGINE_LABELS, TTFT),
    "vllm:inter_token_latency_seconds": ("histogram", ENGINE_LABELS, ITL),
    "vllm:request_time_per_output_token_seconds": ("histogram", ENGINE_LABELS, ITL),
    "vllm:e2e_request_latency_seconds": ("histogram", ENGINE_LABELS, REQUEST_LATENCY),
}
BLOCKTUNE_METRICS = {
    "blocktune_worker_block_size": "gauge",
    "blocktune_worker_last_swap_pause_seconds": "gauge",
    "blocktune_worker_swaps": "counter",
    "blocktune_worker_cancelled": "counter",
}


@pytest.fixture
def worker(live_server):
    loaded = load_pretrained(MODEL)
    loop = EngineLoop(Engine(loaded.model, EngineConfig(block_size=8, num_blocks=256)))
    pusher = LengthPusher("http://127.0.0.1:9")  # never started: only its gauges are read
    loop.start()
    app = create_worker_app(loop, model_name=MODEL, tokenizer=loaded.tokenizer, pusher=pusher)
    with live_server(app) as url:
        yield url
    loop.stop()


def scrape(url: str) -> tuple[str, dict]:
    text = httpx.get(f"{url}/metrics").text
    return text, {family.name: family for family in text_string_to_metric_families(text)}


def sample(families: dict, family: str, suffix: str = "", **labels) -> float:
    """The one sample `family + suffix` with `labels` (besides model_name and engine)."""
    found = [
        s.value
        for s in families[family].samples
        if s.name == family + suffix and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(found) == 1, (family, suffix, labels)
    return found[0]


def test_vllms_names_types_labels_and_buckets(worker):
    httpx.post(f"{worker}/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30)
    _, families = scrape(worker)
    for name, (kind, labels, buckets) in VLLM_METRICS.items():
        family = families[name]
        assert family.type == kind, name
        assert family.documentation, name
        for s in family.samples:
            assert labels <= set(s.labels) - {"le"}, (name, s.labels)
            if "engine" in s.labels:
                assert s.labels["engine"] == "0"
            if "model_name" in s.labels:
                assert s.labels["model_name"] == MODEL
        if buckets is not None:
            bounds = [float(s.labels["le"]) for s in family.samples if s.name == name + "_bucket"]
            assert bounds == [*map(float, buckets), math.inf], name
    for name, kind in BLOCKTUNE_METRICS.items():
        assert families[name].type == kind, name
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert {"stop", "length", "abort"} <= reasons


def test_metrics_count_what_was_served(worker):
    prompts = ["Hello", "How are you doing today?", "Refund please"]
    usages = []
    for prompt in prompts:
        body = {"prompt": prompt, "max_tokens": 5, "temperature": 0}
        usages.append(httpx.post(f"{worker}/v1/completions", json=body, timeout=30).json()["usage"])
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2, "seed": 1}
    usages.append(
        httpx.post(f"{worker}/v1/chat/completions", json=chat, timeout=30).json()["usage"]
    )
    _, families = scrape(worker)
    requests = len(prompts) + 2  # the chat's two choices are two requests
    prompt_tokens = sum(u["prompt_tokens"] for u in usages[:-1]) + 2 * usages[-1]["prompt_tokens"]
    generated = sum(u["completion_tokens"] for u in usages)
    assert sample(families, "vllm:prompt_tokens", "_total") == prompt_tokens
    assert sample(families, "vllm:generation_tokens", "_total") == generated
    assert sample(families, "vllm:time_to_first_token_seconds", "_count") == requests
    assert sample(families, "vllm:inter_token_latency_seconds", "_count") == generated - requests
    assert sample(families, "vllm:request_time_per_output_token_seconds", "_count") == requests
    assert sample(families, "vllm:e2e_request_latency_seconds", "_count") == requests
    assert sample(families, "vllm:request_prompt_tokens", "_sum") == prompt_tokens
    assert sample(families, "vllm:request_prompt_tokens", "_bucket", le="+Inf") == requests
    assert sample(families, "vllm:request_params_max_tokens", "_sum") == 3 * 5 + 2 * 4
    success = "vllm:request_success"
    assert sample(families, success, "_total", finished_reason="length") == requests
    assert sample(families, success, "_total", finished_reason="stop") == 0
    assert sample(families, "vllm:num_requests_running") == 0
    assert sample(families, "vllm:kv_cache_usage_perc") == 0
    assert sample(families, "vllm:cache_config_info", block_size="8", num_gpu_blocks="256") == 1
    assert sample(families, "blocktune_worker_block_size") == 8


def test_a_stop_string_counts_once_as_a_success_and_never_as_cancelled(worker):
    body = {"prompt": "Hello", "max_tokens": 12, "temperature": 0}
    text = httpx.post(f"{worker}/v1/completions", json=body, timeout=30).json()["choices"][0]
    stop = text["text"][2:4]  # met after a few tokens, before max_tokens
    assert stop
    stopped = httpx.post(f"{worker}/v1/completions", json={**body, "stop": stop}, timeout=30)
    assert stopped.json()["choices"][0]["finish_reason"] == "stop"
    _, families = scrape(worker)
    success = "vllm:request_success"
    assert sample(families, success, "_total", finished_reason="stop") == 1
    assert sample(families, success, "_total", finished_reason="length") == 1
    assert sample(families, success, "_total", finished_reason="abort") == 0
    assert sample(families, "blocktune_worker_cancelled", "_total") == 0


def test_a_running_request_shows_in_the_gauges(worker):
    body = {"prompt_ids": [1] * 20, "max_tokens": 2000, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{worker}/v1/completions", json=body, timeout=60) as stream:
        lines = stream.iter_lines()  # kept: a dropped iterator closes the stream
        next(lines)
        _, families = scrape(worker)
    assert sample(families, "vllm:num_requests_running") == 1
    usage = sample(families, "vllm:kv_cache_usage_perc")
    assert 3 / 256 <= usage <= 1


def test_blocktunes_own_names_follow_prometheus_conventions(worker):
    httpx.post(f"{worker}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    _, families = scrape(worker)
    assert set(families) >= set(VLLM_METRICS) | set(BLOCKTUNE_METRICS)
    for name, family in families.items():
        assert name.startswith(("vllm:", "blocktune_worker_")), name
        assert family.documentation, name
        assert not name.endswith(("_count", "_sum", "_bucket")), name
        if name.startswith("blocktune_worker_"):
            assert not ABBREVIATED.search(name), name
            for s in family.samples:
                assert s.labels["model_name"] == MODEL, s
        for s in family.samples:
            if family.type == "counter":
                assert s.name.endswith(("_total", "_created")), s.name


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_finds_nothing_but_vllms_colons(worker):
    """promtool's lint refuses ':' in metric names, vLLM's own exposition included; nothing
    else may be found."""
    httpx.post(f"{worker}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    text, families = scrape(worker)
    lint = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    findings = (lint.stdout + lint.stderr).strip().splitlines()
    colons = [
        f for f in findings if re.fullmatch(r"vllm:\S+ metric names should not contain ':'", f)
    ]
    assert findings == colons, findings
    assert len(colons) == sum(name.startswith("vllm:") for name in families)
