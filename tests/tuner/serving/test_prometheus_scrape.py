"""A real Prometheus scraping the worker on loopback answers vLLM's queries without relabelling
(skipped where the `prometheus` server is not installed, e.g. `apt-get install prometheus`)."""

import shutil
import socket
import subprocess
import time

import httpx
import pytest

from blocktune.runtime.config import EngineConfig
from blocktune.runtime.engine import Engine
from blocktune.runtime.engine_loop import EngineLoop
from blocktune.runtime.loading import load_pretrained
from blocktune.tuner.serving.worker_app import create_worker_app

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("prometheus") is None, reason="the prometheus server is not installed"
    ),
]
QUERIES = (
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "histogram_quantile(0.99, rate(vllm:time_to_first_token_seconds_bucket[1m]))",
)
WAIT_S = 60


@pytest.fixture
def worker(live_server):
    loaded = load_pretrained("tiny-random")
    loop = EngineLoop(Engine(loaded.model, EngineConfig(block_size=8, num_blocks=256)))
    loop.start()
    with live_server(create_worker_app(loop, model_name="tiny", tokenizer=None)) as url:
        yield url
    loop.stop()


@pytest.fixture
def prometheus(worker, tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    target = worker.removeprefix("http://")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s}\n"
        f"scrape_configs: [{{job_name: worker, static_configs: [{{targets: ['{target}']}}]}}]\n"
    )
    server = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    yield f"http://127.0.0.1:{port}"
    server.terminate()
    server.wait(timeout=30)


def query(prometheus: str, expression: str) -> list:
    """The result vector of `expression`; empty while Prometheus is still starting."""
    try:
        response = httpx.get(f"{prometheus}/api/v1/query", params={"query": expression})
    except httpx.TransportError:
        return []
    return response.json()["data"]["result"] if response.status_code == 200 else []


def test_vllms_queries_return_data(worker, prometheus):
    answers: dict[str, list] = {}
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and len(answers) < len(QUERIES):
        for _ in range(3):  # traffic, so the TTFT histogram has a rate
            body = {"prompt_ids": [1, 2, 3], "max_tokens": 2}
            httpx.post(f"{worker}/v1/completions", json=body, timeout=30)
        for expression in QUERIES:
            result = query(prometheus, expression)
            if result and result[0]["value"][1] != "NaN":
                answers[expression] = result
        time.sleep(1)
    assert set(answers) == set(QUERIES), answers
    running = answers["vllm:num_requests_running"][0]
    assert running["metric"]["model_name"] == "tiny" and running["metric"]["engine"] == "0"
    assert float(answers[QUERIES[2]][0]["value"][1]) > 0
