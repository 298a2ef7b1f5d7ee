"""/metrics: vLLM's metrics under Prometheus' naming rules, counting what was served."""

import re
import shutil
import subprocess

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from blocktune.runtime.engine import Engine, EngineConfig
from blocktune.runtime.engine_loop import EngineLoop
from blocktune.runtime.loading import load_pretrained
from blocktune.tuner.serving.worker_app import LengthPusher, create_worker_app

MODEL = "tiny-random"
# promtool's lint: abbreviated units and non-base units are refused in names.
ABBREVIATED = re.compile(r"_(s|ms|us|ns|sec|b|kb|mb|gb|m|h|d|perc|percent)(_|$)")


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


def sample(families: dict, family: str, name: str, **labels) -> float:
    """The one sample `name` of `family` with `labels` (besides model_name)."""
    found = [
        s.value
        for s in families[f"blocktune_worker_{family}"].samples
        if s.name == f"blocktune_worker_{name}"
        and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(found) == 1, (family, name, labels)
    return found[0]


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
    assert sample(families, "prompt_tokens", "prompt_tokens_total") == prompt_tokens
    assert sample(families, "generation_tokens", "generation_tokens_total") == generated
    ttft = "time_to_first_token_seconds"
    assert sample(families, ttft, f"{ttft}_count") == requests
    gaps = "time_per_output_token_seconds"
    assert sample(families, gaps, f"{gaps}_count") == generated - requests
    assert sample(families, "e2e_request_latency_seconds", "e2e_request_latency_seconds_count") == (
        requests
    )
    lengths = "request_prompt_tokens"
    assert sample(families, lengths, f"{lengths}_sum") == prompt_tokens
    assert sample(families, lengths, f"{lengths}_bucket", le="+Inf") == requests
    success = "request_success"
    assert sample(families, success, f"{success}_total", finished_reason="length") == requests
    assert sample(families, "num_requests_running", "num_requests_running") == 0
    assert sample(families, "kv_cache_usage_ratio", "kv_cache_usage_ratio") == 0
    assert sample(families, "block_size", "block_size") == 8


def test_a_running_request_shows_in_the_gauges(worker):
    body = {"prompt_ids": [1] * 20, "max_tokens": 2000, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{worker}/v1/completions", json=body, timeout=60) as stream:
        lines = stream.iter_lines()  # kept: a dropped iterator closes the stream
        next(lines)
        _, families = scrape(worker)
    assert sample(families, "num_requests_running", "num_requests_running") == 1
    usage = sample(families, "kv_cache_usage_ratio", "kv_cache_usage_ratio")
    assert 3 / 256 <= usage <= 1


def test_names_follow_prometheus_conventions(worker):
    httpx.post(f"{worker}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    _, families = scrape(worker)
    assert len(families) >= 20
    for name, family in families.items():
        assert name.startswith("blocktune_worker_") and ":" not in name, name
        assert family.documentation, name
        assert not ABBREVIATED.search(name), name
        assert not name.endswith(("_count", "_sum", "_bucket")), name
        for s in family.samples:
            assert s.labels["model_name"] == MODEL, s
            if family.type == "counter":
                assert s.name.endswith(("_total", "_created")), s.name


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_finds_nothing_to_lint(worker):
    httpx.post(f"{worker}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    text, _ = scrape(worker)
    lint = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert lint.returncode == 0 and not lint.stdout.strip() and not lint.stderr.strip(), lint
