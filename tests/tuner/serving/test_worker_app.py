"""The engine as an HTTP worker: real uvicorn on loopback, real HTTP."""

import concurrent.futures
import random
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from blocktune.runtime.config import EngineConfig
from blocktune.runtime.engine import Engine
from blocktune.runtime.engine_loop import EngineLoop
from blocktune.runtime.loading import load_weights
from blocktune.runtime.requests import FinishedRequest
from blocktune.runtime.sampling import SamplingParams
from blocktune.runtime.tokenizer import Tokenizer
from blocktune.tuner.serving.worker_app import LengthPusher, create_worker_app

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def model():
    return load_weights("tiny-random", seed=0)


def _engine(model, **config):
    return Engine(model, EngineConfig(**{"block_size": 8, "num_blocks": 256, **config}))


def _app(loop):
    return create_worker_app(
        loop, model_name="tiny-random", tokenizer=Tokenizer.byte_level(), token=TOKEN
    )


@pytest.fixture
def worker(model, live_server):
    loop = EngineLoop(_engine(model))
    loop.start()
    with live_server(_app(loop)) as url:
        yield url, loop
    loop.stop()


def _prompts(count, seed):
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(3, 40))] for _ in range(count)]


def test_concurrent_completions_match_the_engine_and_swaps_keep_them(model, worker):
    url, loop = worker
    prompts = _prompts(12, seed=1)
    expected = [
        o.token_ids for o in _engine(model).generate(prompts, SamplingParams(max_tokens=12))
    ]

    def complete(prompt):
        body = {"prompt_ids": prompt, "max_tokens": 12, "temperature": 0}
        return httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(complete, p) for p in prompts]
        swaps = [
            httpx.post(f"{url}/admin/block-size", json={"block_size": b}, headers=AUTH, timeout=60)
            for b in (32, 16)
        ]
        results = [f.result() for f in futures]
    assert [r["choices"][0]["token_ids"] for r in results] == expected
    assert all(r["choices"][0]["finish_reason"] == "length" for r in results)
    assert results[0]["usage"] == {
        "prompt_tokens": len(prompts[0]),
        "completion_tokens": 12,
        "total_tokens": len(prompts[0]) + 12,
    }
    assert [s.json()["status"] for s in swaps] == ["done", "done"]
    state = httpx.get(f"{url}/admin/state").json()
    assert state["block_size"] == 16 and state["running"] == 0
    assert state["blocks_used"] == 0 and state["completed"] == 12
    assert [h["new_block_size"] for h in state["swap_history"]] == [32, 16]
    loop.check()


def test_admin_needs_the_token(worker):
    url, _ = worker
    response = httpx.post(f"{url}/admin/block-size", json={"block_size": 32})
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
    assert response.json()["error"]["message"] == "missing or wrong bearer token"
    wrong = {"Authorization": "Bearer nope"}
    response = httpx.post(f"{url}/admin/block-size", json={"block_size": 32}, headers=wrong)
    assert response.status_code == 401


@pytest.mark.parametrize("size", [24, 0, -16, 2**70, 256, "16", 16.0, True, None])
def test_invalid_block_sizes_are_422_and_change_nothing(worker, size):
    url, loop = worker
    response = httpx.post(f"{url}/admin/block-size", json={"block_size": size}, headers=AUTH)
    assert response.status_code == 422
    assert response.json()["error"]["param"] == "block_size"
    assert loop.state()["block_size"] == 8 and loop.state()["swaps_done"] == 0


def test_a_swap_that_cannot_be_applied_is_200_with_its_reason(model, live_server):
    engine = _engine(model)

    def fault(phase):
        raise RuntimeError(f"injected {phase} fault")

    engine.swap_fault_hook = fault
    loop = EngineLoop(engine)
    loop.start()
    with live_server(_app(loop)) as url:
        # A grow copies only when a sequence is live: keep one generating meanwhile.
        body = {"prompt_ids": [1] * 9, "max_tokens": 2000, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()  # kept: a dropped iterator closes the stream
            next(lines)
            swap = httpx.post(
                f"{url}/admin/block-size", json={"block_size": 32}, headers=AUTH, timeout=60
            )
    loop.stop()
    assert swap.status_code == 200
    assert swap.json()["status"] == "rolled_back" and "injected" in swap.json()["reason"]
    assert loop.state()["block_size"] == 8


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"prompt_ids": [], "max_tokens": 4}, 422, "prompt_ids"),
        ({"prompt_ids": [1, 999], "max_tokens": 4}, 400, "token id 999"),
        ({"prompt_ids": [1, 999], "max_tokens": 4, "echo": True}, 400, "cannot be decoded"),
        ({"prompt_ids": [2**71], "max_tokens": 4, "echo": True}, 400, "cannot be decoded"),
        # The pool (256 blocks of 8) holds fewer tokens than the model's 4096 positions.
        ({"prompt_ids": list(range(200)) * 11, "max_tokens": 4}, 400, "max_model_len 2049"),
        ({"prompt_ids": [1], "max_tokens": 0}, 422, "max_tokens"),
        ({"prompt_ids": [1], "prompt": "hi"}, 422, "exactly one"),
        ({"prompt_ids": [1], "bogus": 1}, 422, "bogus"),
    ],
)
def test_bad_requests_get_4xx_and_the_worker_keeps_serving(worker, body, status, needle):
    url, _ = worker
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert response.status_code == status
    assert needle in response.json()["error"]["message"]
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 3}, timeout=30)
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 3


def test_oversized_body_is_refused(worker):
    url, _ = worker
    response = httpx.post(
        f"{url}/v1/completions",
        content=b'{"prompt_ids": [' + b"1," * 600_000 + b"1]}",
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 413


@pytest.mark.parametrize("stream", [False, True])
def test_disconnected_client_frees_its_blocks(worker, stream):
    url, loop = worker
    body = {"prompt_ids": [1, 2, 3], "max_tokens": 1500, "stream": stream}
    if stream:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json=body, timeout=0.3)
    for _ in range(100):
        state = loop.state()
        if state["cancelled"] == 1:
            break
        time.sleep(0.05)
    assert state["cancelled"] == 1 and state["running"] == 0 and state["blocks_used"] == 0
    loop.check()


def test_length_pusher_batches_retries_and_bounds_its_backlog(live_server):
    from fastapi import FastAPI

    received = []
    app = FastAPI()

    @app.post("/v1/observations")
    async def observations(items: list[dict]) -> dict:
        received.extend(items)
        return {"accepted": len(items)}

    record = FinishedRequest(0, 10, 5, 0.0, 1.0, "length")
    down = LengthPusher("http://127.0.0.1:9", max_backlog=3, flush_interval_s=0.01)
    for _ in range(5):
        down.observe(record)
    assert down.backlog() == 3 and down.dropped == 2
    with live_server(app) as url:
        pusher = LengthPusher(url, batch_size=4, flush_interval_s=0.02)
        pusher.start()
        for _ in range(10):
            pusher.observe(record)
        for _ in range(200):
            if len(received) == 10:
                break
            time.sleep(0.02)
        pusher.stop()
    assert len(received) == 10 and pusher.sent == 10 and pusher.backlog() == 0
    assert received[0]["prompt_tokens"] == 10 and received[0]["output_tokens"] == 5


def test_pusher_removes_only_what_it_sent_when_the_backlog_overflows(live_server):
    import asyncio

    from fastapi import FastAPI

    received = []
    app = FastAPI()

    @app.post("/v1/observations")
    async def observations(items: list[dict]) -> dict:
        await asyncio.sleep(0.5)  # a slow sidecar: the backlog overflows meanwhile
        received.extend(item["prompt_tokens"] for item in items)
        return {"accepted": len(items)}

    with live_server(app) as url:
        pusher = LengthPusher(url, max_backlog=3, flush_interval_s=0.05)
        for n in (1, 2, 3):
            pusher.observe(FinishedRequest(0, n, 1, 0.0, 0.0, "length"))
        pusher.start()
        time.sleep(0.25)  # the POST of 1, 2, 3 is in flight
        for n in (4, 5, 6):
            pusher.observe(FinishedRequest(0, n, 1, 0.0, 0.0, "length"))
        for _ in range(100):
            if len(received) == 6:
                break
            time.sleep(0.05)
        pusher.stop()
    # 1, 2 and 3 were sent before they were dropped from the backlog; 4, 5, 6 still go out.
    assert received == [1, 2, 3, 4, 5, 6]
    assert pusher.dropped == 3 and pusher.backlog() == 0


def test_a_failing_step_fails_the_requests_in_flight_and_the_worker_recovers(
    model, live_server, monkeypatch
):
    loop = EngineLoop(_engine(model))
    forward_step = loop.engine.model.forward_step
    calls = {"n": 0}

    def flaky_forward_step(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected device fault")
        return forward_step(*args, **kwargs)

    monkeypatch.setattr(loop.engine.model, "forward_step", flaky_forward_step)
    loop.start()
    with live_server(_app(loop)) as url:
        body = {"prompt_ids": [1, 2, 3], "max_tokens": 5}
        failed = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert failed.status_code == 503
        assert "injected device fault" in failed.json()["error"]["message"]
        ok = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 5
        state = httpx.get(f"{url}/admin/state").json()
    loop.stop()
    assert state["failed_steps"] == 1 and state["blocks_used"] == 0
    loop.check()


def test_worker_command_takes_its_pool_candidates_and_token_env_from_a_policy(tmp_path, capsys):
    from blocktune.tuner.cli import build_parser, main
    from blocktune.tuner.cli.worker import config_from_args

    policy = tmp_path / "policy.yaml"
    default = Path(__file__).resolve().parents[3] / "policies" / "default.yaml"
    text = default.read_text().replace("[8, 16, 32, 64, 128]", "[8, 32]")
    text = text.replace("kv_budget: 4GiB", "kv_budget: 96MiB")
    policy.write_text(text + "auth: {token_env: MY_WORKER_TOKEN}\n")
    parse = build_parser().parse_args
    config = config_from_args(parse(["worker", "--policy", str(policy)]))
    # 16 is not a candidate: the policy starts at the candidate nearest to it (8 and 32 tie
    # at a factor of 2; the smaller wins), and the pool is the policy's budget.
    assert (config.engine.kv_bytes, config.engine.block_size) == (96 * 2**20, 8)
    assert (config.engine.candidate_block_sizes, config.token_env) == ((8, 32), "MY_WORKER_TOKEN")
    flags = parse(
        ["worker", "--policy", str(policy), "--candidates", "16", "--token-env", "T"]
        + ["--kv-bytes", "1MiB", "--block-size", "16"]
    )
    config = config_from_args(flags)
    assert (config.engine.kv_bytes, config.engine.block_size) == (2**20, 16)
    assert (config.engine.candidate_block_sizes, config.token_env) == ((16,), "T")
    bare = config_from_args(parse(["worker"]))
    assert (bare.engine.kv_bytes, bare.engine.block_size) == (64 * 2**20, 16)
    assert bare.engine.candidate_block_sizes == (8, 16, 32, 64, 128)
    assert bare.token_env == "BLOCKTUNE_TOKEN"
    policy.write_text("deployment: x\nbogus: 1\n")
    assert main(["worker", "--policy", str(policy)]) == 2
    assert "bogus" in capsys.readouterr().err


def test_monitoring_answers_while_a_step_is_in_progress(model, live_server):
    """`/metrics` and `/admin/state` answer from the state published after the last step, not
    after the step in progress: here one held until both have answered."""
    engine = _engine(model)
    entered, release = threading.Event(), threading.Event()
    step = engine.step

    def slow_step():
        if engine.has_unfinished():
            entered.set()
            release.wait(60)
        return step()

    engine.step = slow_step
    loop = EngineLoop(engine)
    loop.start()
    try:
        with live_server(_app(loop)) as url:
            body = {"prompt_ids": [1, 2, 3], "max_tokens": 2, "temperature": 0}
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                completion = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=60)
                assert entered.wait(30)
                metrics = httpx.get(f"{url}/metrics", timeout=10)
                state = httpx.get(f"{url}/admin/state", timeout=10)
                assert not completion.done()  # the step was still held
                release.set()
                assert completion.result().status_code == 200
        assert metrics.status_code == 200 and "blocktune_worker_block_size" in metrics.text
        assert state.status_code == 200 and state.json()["block_size"] == 8
        # As published after the request was admitted, before the step that was held.
        assert state.json()["waiting"] == 1 and state.json()["completed"] == 0
    finally:
        release.set()
        loop.stop()
    assert loop.state()["completed"] == 1 and loop.state()["steps"] >= 2


def test_worker_threads_flag_sets_torch_threads_and_refuses_zero(capsys, monkeypatch):
    from blocktune.tuner.cli import main

    threads = torch.get_num_threads()
    served = []
    monkeypatch.setattr(
        "blocktune.tuner.serving.worker_app.serve_worker",
        lambda loop, **_: served.append(torch.get_num_threads()),
    )
    try:
        assert main(["worker", "--threads", "1"]) == 0
        assert served == [1]
        assert main(["worker", "--threads", "0"]) == 2
        assert "--threads must be at least 1, got 0" in capsys.readouterr().err
    finally:
        torch.set_num_threads(threads)


def test_prefix_caching_flags_reach_the_engine_config():
    """On by default, as vLLM has it, but off where prefills are chunked (the engine cannot
    combine the two); either flag says so outright."""
    from blocktune.tuner.cli import build_parser
    from blocktune.tuner.cli.worker import config_from_args

    parse = build_parser().parse_args

    def caching(*flags):
        return config_from_args(parse(["worker", *flags])).engine.enable_prefix_caching

    assert caching() and caching("--enable-prefix-caching")
    assert not caching("--no-enable-prefix-caching")
    assert not caching("--max-num-batched-tokens", "256")
    with pytest.raises(ValueError, match="cannot be combined with enable_prefix_caching"):
        caching("--max-num-batched-tokens", "256", "--enable-prefix-caching")
