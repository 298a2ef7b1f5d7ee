"""The vLLM metrics source against a local server whose histograms change between scrapes."""

import json
import socket
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from blocktune.tuner.config.policy import Sources, VllmMetricsSettings, load_policy
from blocktune.tuner.serving.sidecar_app import create_sidecar_app
from blocktune.tuner.sidecar.assembly import build_sidecar
from blocktune.tuner.sidecar.sources import SourceRunner
from blocktune.tuner.sidecar.vllm_metrics import Histogram, VllmMetricsSource, spread_samples

POLICY = load_policy(Path(__file__).resolve().parents[3] / "policies" / "default.yaml")
BOUNDS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
ENGINE_A = {"engine": "0", "model_name": "llama"}
ENGINE_B = {"engine": "1", "model_name": "llama"}


class FakeVllm:
    """Cumulative prompt/generation histograms per label set, as a vLLM server keeps them."""

    def __init__(self, block_size: int = 16) -> None:
        self.block_size = block_size
        self.series: dict[tuple, dict] = {}

    def add(self, labels: dict, prompts, outputs) -> None:
        key = tuple(sorted(labels.items()))
        for name, values in (("prompt", prompts), ("generation", outputs)):
            entry = self.series.setdefault((name, key), {"values": []})
            entry["values"].extend(int(v) for v in values)

    def restart(self, labels: dict) -> None:
        key = tuple(sorted(labels.items()))
        for name in ("prompt", "generation"):
            self.series[(name, key)] = {"values": []}

    def text(self, *, without_labels: dict | None = None, without_generation=False) -> str:
        lines = []
        for name in ("prompt", "generation"):
            if name == "generation" and without_generation:
                continue
            metric = f"vllm:request_{name}_tokens"
            lines += [f"# HELP {metric} Number of {name} tokens.", f"# TYPE {metric} histogram"]
            for (kind, key), entry in self.series.items():
                if kind != name or (
                    without_labels and key == tuple(sorted(without_labels.items()))
                ):
                    continue
                values = np.asarray(entry["values"], dtype=np.int64)
                labels = ",".join(f'{k}="{v}"' for k, v in key)
                for bound in BOUNDS:
                    count = int((values <= bound).sum())
                    lines.append(f'{metric}_bucket{{{labels},le="{float(bound)}"}} {count}.0')
                lines.append(f'{metric}_bucket{{{labels},le="+Inf"}} {len(values)}.0')
                lines.append(f"{metric}_sum{{{labels}}} {float(values.sum())}")
                lines.append(f"{metric}_count{{{labels}}} {len(values)}.0")
        lines += [
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="{self.block_size}",cache_dtype="auto"}} 1.0',
            "# HELP vllm:num_requests_running Running requests.",
            "# TYPE vllm:num_requests_running gauge",
            'vllm:num_requests_running{engine="0",model_name="llama"} 3.0',
        ]
        return "\n".join(lines) + "\n"


def serve_exposition(holder: dict) -> FastAPI:
    app = FastAPI()

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(holder["text"])

    return app


def lengths(rng, count: int, long_share: float = 0.1):
    prompts = rng.integers(1, 1800, count)
    prompts[rng.random(count) < long_share] = rng.integers(2001, 6000)
    outputs = rng.integers(0, 400, count)
    outputs[rng.random(count) < long_share] = rng.integers(2001, 3000)
    return prompts, outputs


def bucket_counts(values) -> np.ndarray:
    return np.bincount(np.searchsorted(BOUNDS, values, side="left"), minlength=len(BOUNDS) + 1)


def test_scrapes_become_samples_with_the_histograms_bucket_counts(live_server):
    rng = np.random.default_rng(7)
    vllm = FakeVllm()
    vllm.add(ENGINE_A, *lengths(rng, 500))  # history before the sidecar: only a baseline
    vllm.add(ENGINE_B, *lengths(rng, 300))
    holder = {"text": vllm.text()}
    received, sizes, new_prompts, new_outputs = [], [], [], []

    def add(labels, count):
        prompts, outputs = lengths(rng, count)
        vllm.add(labels, prompts, outputs)
        new_prompts.extend(prompts)
        new_outputs.extend(outputs)

    with live_server(serve_exposition(holder)) as url:
        settings = VllmMetricsSettings(url=f"{url}/metrics", interval="1s")
        clock = iter(float(t) for t in range(1000, 2000, 10))
        source = VllmMetricsSource(
            settings,
            received.append,
            sizes.append,
            clock=lambda: next(clock),
        )
        assert source.poll() == 0 and sizes == [16]  # baseline

        add(ENGINE_A, 120)
        add(ENGINE_B, 80)
        holder["text"] = vllm.text()
        assert source.poll() == 200

        add(ENGINE_A, 50)
        add(ENGINE_B, 40)  # engine B's series is missing from this scrape ...
        holder["text"] = vllm.text(without_labels=ENGINE_B)
        assert source.poll() == 50

        vllm.restart(ENGINE_A)  # ... and back in the next, while engine A restarted
        add(ENGINE_A, 30)
        add(ENGINE_B, 10)
        holder["text"] = vllm.text()
        assert source.poll() == 40 + 10 + 30

        add(ENGINE_A, 25)  # the generation histogram is missing: prompts wait for it
        holder["text"] = vllm.text(without_generation=True)
        assert source.poll() == 0
        vllm.block_size = 32
        holder["text"] = vllm.text()
        assert source.poll() == 25 and sizes[-1] == 32
        source.close()

    prompts = np.concatenate([b.prompt_tokens for b in received])
    outputs = np.concatenate([b.output_tokens for b in received])
    assert len(prompts) == len(new_prompts) == 355
    assert bucket_counts(prompts).tolist() == bucket_counts(new_prompts).tolist()
    assert bucket_counts(outputs).tolist() == bucket_counts(new_outputs).tolist()
    # _sum keeps the mean: off by less than one token per series and scrape (rounding).
    assert abs(int(prompts.sum()) - int(np.sum(new_prompts))) <= 8
    assert abs(int(outputs.sum()) - int(np.sum(new_outputs))) <= 8
    assert prompts.min() >= 1 and outputs.min() >= 0
    # Timestamps are spread over each scrape interval of the fake clock.
    first = received[0].timestamps
    assert first.min() > 1000 and first.max() == 1010 and np.all(np.diff(first) > 0)


def test_spread_samples_stays_in_buckets_and_matches_the_sum():
    histogram = Histogram(
        (10.0, 100.0, float("inf")), (4.0, 10.0, 12.0), 4 * 7 + 6 * 60 + 2 * 500, 12
    )
    samples = spread_samples(histogram, minimum=1)
    assert np.bincount(np.searchsorted([10, 100], samples, side="left")).tolist() == [4, 6, 2]
    assert samples.sum() == 4 * 7 + 6 * 60 + 2 * 500
    # Without a sum the +Inf samples sit at the bucket's lower edge.
    no_sum = Histogram((10.0, float("inf")), (2.0, 3.0), float("nan"), 3)
    assert spread_samples(no_sum, minimum=1).tolist()[-1] == 11


def test_sidecar_recommends_a_restart_for_vllm(live_server, caplog):
    """vLLM at B=32 with a KV budget short traffic fills: a restart with 16 (vLLM's backend
    takes multiples of 16 only) pays back within the dwell, so the sidecar advises it."""
    rng = np.random.default_rng(1)
    vllm = FakeVllm(block_size=32)
    vllm.add(ENGINE_A, [100], [100])
    holder = {"text": vllm.text()}
    with live_server(serve_exposition(holder)) as vllm_url:
        settings = VllmMetricsSettings(url=f"{vllm_url}/metrics", interval="0.1s")
        policy = POLICY.model_copy(
            update={
                "sources": Sources(push=False, vllm_metrics=settings),
                "mode": "enforce",
                "engine": "vllm",
                "candidates": (16, 32, 64, 128),
                "kv_budget": 48 * 2**20,
            }
        )
        sidecar = build_sidecar(policy)
        with live_server(create_sidecar_app(sidecar)) as url:
            assert wait_for(lambda: httpx.get(f"{url}/readyz").status_code == 200)
            with caplog.at_level("INFO", logger="blocktune.sidecar"):
                vllm.add(ENGINE_A, rng.integers(15, 26, 400), rng.integers(8, 25, 400))
                holder["text"] = vllm.text()
                # The window reaches min_samples at once: the sidecar decides then.
                assert wait_for(lambda: sidecar.scheduler.runs == 1)
                body = httpx.get(f"{url}/v1/recommendation").json()
                again = httpx.post(f"{url}/v1/decide").json()
            assert body["current_block_size"] == 32 and body["block_size"] == 16
            assert body["material"] is True and body["switch_cost_s"] == 60.0
            assert body["action"] == again["action"] == "restart vLLM with --block-size 16"
            assert body["enforcing"] is False  # vLLM cannot swap: a recommendation
            events = [
                json.loads(r.message)["event"]
                for r in caplog.records
                if r.name == "blocktune.sidecar"
            ]
            assert events.count("decision") == 2 and events.count("recommendation") == 1
            metrics = httpx.get(f"{url}/metrics").text
            assert "blocktune_recommended_block_size 16.0" in metrics
            assert "blocktune_current_block_size 32.0" in metrics
            assert httpx.post(f"{url}/v1/observations", json=[]).status_code == 403


@pytest.mark.parametrize("reported", [24, 2**20])
def test_a_reported_size_that_is_no_block_size_is_counted_and_ignored(live_server, reported):
    holder = {"text": FakeVllm(block_size=reported).text()}
    with live_server(serve_exposition(holder)) as vllm_url:
        settings = VllmMetricsSettings(url=f"{vllm_url}/metrics")
        sidecar = build_sidecar(
            POLICY.model_copy(update={"sources": Sources(push=False, vllm_metrics=settings)})
        )
        SourceRunner.poll(sidecar.sources[0])
    assert sidecar.current_block_size == 16
    status = sidecar.statuses["vllm_metrics"].to_dict()
    assert (
        status["errors"] == 1
        and f"block_size {reported} is not a power of two" in (status["last_error"])
    )
    sidecar.sources[0].close()


def test_an_unreachable_vllm_is_counted_and_not_ready():
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    settings = VllmMetricsSettings(url=f"http://127.0.0.1:{port}/metrics", timeout="1s")
    policy = POLICY.model_copy(update={"sources": Sources(push=False, vllm_metrics=settings)})
    sidecar = build_sidecar(policy)
    source = sidecar.sources[0]
    SourceRunner.poll(source)
    SourceRunner.poll(source)
    status = sidecar.readiness()
    assert status["ready"] is False
    assert status["sources"]["vllm_metrics"]["last_ok"] is False
    assert "ConnectError" in status["sources"]["vllm_metrics"]["last_error"]
    assert sidecar.stats().source_errors == {"vllm_metrics": 2}
    source.close()


def wait_for(condition, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(autouse=True)
def _quiet_scheduler(caplog):
    caplog.set_level("WARNING", logger="apscheduler")


def test_pointed_at_blocktunes_worker_it_fills_the_window(live_server):
    """The worker exports vLLM's names, so the vLLM source reads it as it reads vLLM: each
    finished request becomes one observation, inside its histogram buckets."""
    from blocktune.runtime.config import EngineConfig
    from blocktune.runtime.engine import Engine
    from blocktune.runtime.engine_loop import EngineLoop
    from blocktune.runtime.loading import load_pretrained
    from blocktune.tuner.serving.worker_app import create_worker_app

    loaded = load_pretrained("tiny-random")
    loop = EngineLoop(Engine(loaded.model, EngineConfig(block_size=16, num_blocks=128)))
    loop.start()
    app = create_worker_app(loop, model_name="tiny-random", tokenizer=loaded.tokenizer)
    try:
        with live_server(app) as worker:
            settings = VllmMetricsSettings(url=f"{worker}/metrics")
            policy = POLICY.model_copy(
                update={"sources": Sources(push=False, vllm_metrics=settings)}
            )
            sidecar = build_sidecar(policy)
            source = sidecar.sources[0]
            SourceRunner.poll(source)  # the baseline
            for prompt_ids, max_tokens in (([1] * 3, 4), ([2] * 30, 7), ([3] * 300, 12)):
                body = {"prompt_ids": prompt_ids, "max_tokens": max_tokens, "ignore_eos": True}
                httpx.post(f"{worker}/v1/completions", json=body, timeout=60).raise_for_status()
            SourceRunner.poll(source)
            source.close()
    finally:
        loop.stop()
    assert len(sidecar.window) == 3
    assert sidecar.current_block_size == 16
    status = sidecar.statuses["vllm_metrics"].to_dict()
    assert status["samples"] == 3 and status["errors"] == 0 and status["unobserved_polls"] == 0
    snapshot = sidecar.window.snapshot()
    # Lengths 3, 30, 300 and 4, 7, 12 land in vLLM's buckets (2, 5], (20, 50], (200, 500]
    # and (2, 5], (5, 10], (10, 20].
    assert bucket_counts(snapshot.prompt_tokens).tolist() == bucket_counts([3, 30, 300]).tolist()
    assert bucket_counts(snapshot.output_tokens).tolist() == bucket_counts([4, 7, 12]).tolist()


def test_requests_that_finish_without_lengths_are_warned_about_and_counted(live_server, caplog):
    finished = 'vllm:request_success_total{{engine="0",finished_reason="stop"}} {}\n'
    holder = {"text": finished.format(5.0)}
    with live_server(serve_exposition(holder)) as vllm_url:
        settings = VllmMetricsSettings(url=f"{vllm_url}/metrics")
        sidecar = build_sidecar(
            POLICY.model_copy(update={"sources": Sources(push=False, vllm_metrics=settings)})
        )
        source = sidecar.sources[0]
        SourceRunner.poll(source)  # the baseline: history is not news
        SourceRunner.poll(source)  # nothing finished: nothing to say
        holder["text"] = finished.format(8.0)
        with caplog.at_level("WARNING", logger="blocktune.sidecar"):
            SourceRunner.poll(source)
        source.close()
    warnings = [json.loads(r.message) for r in caplog.records if r.levelname == "WARNING"]
    assert [w["event"] for w in warnings] == ["vllm_requests_without_lengths"]
    assert warnings[0]["finished"] == 3
    assert sidecar.statuses["vllm_metrics"].to_dict()["unobserved_polls"] == 1
    assert sidecar.stats().source_unobserved_polls == {"vllm_metrics": 1}
    assert len(sidecar.window) == 0
