"""The worker under load: a bounded soak with cancels and swaps, and a faulty swap mid-traffic."""

import concurrent.futures
import random
import threading
import time

import httpx
import pytest

from blocktune.runtime.config import EngineConfig
from blocktune.runtime.engine import Engine
from blocktune.runtime.loading import load_weights
from blocktune.runtime.sampling import SamplingParams
from blocktune.runtime.tokenizer import Tokenizer
from blocktune.tuner.serving.worker_app import EngineLoop, create_worker_app

pytestmark = pytest.mark.slow

TOKEN = "soak-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def model():
    return load_weights("tiny-random", seed=0)


def _requests(count, seed):
    rng = random.Random(seed)
    return [
        ([rng.randrange(256) for _ in range(rng.randint(1, 40))], rng.randint(1, 16))
        for _ in range(count)
    ]


def _swapper(url, sizes, stop, every_s, results):
    rng = random.Random(1)
    while not stop.wait(every_s):
        body = {"block_size": rng.choice(sizes)}
        results.append(httpx.post(f"{url}/admin/block-size", json=body, headers=AUTH, timeout=60))


def guarded_worker(live_server, loop):
    """`with guarded_worker(live_server, loop) as url:` serves `loop` behind the soak's token."""
    app = create_worker_app(
        loop, model_name="tiny-random", tokenizer=Tokenizer.byte_level(), token=TOKEN
    )
    return live_server(app)


def test_soak_two_thousand_requests_with_cancels_and_swaps(model, live_server):
    requests = _requests(2000, seed=7)
    reference = Engine(model, EngineConfig(block_size=16, num_blocks=4096, max_num_seqs=64))
    expected = reference.generate(
        [p for p, _ in requests], [SamplingParams(max_tokens=n) for _, n in requests]
    )
    loop = EngineLoop(Engine(model, EngineConfig(block_size=16, num_blocks=512, max_num_seqs=64)))
    loop.start()
    rng = random.Random(3)
    cancelled = {i for i in range(len(requests)) if rng.random() < 0.05}
    swaps, stop = [], threading.Event()
    # One client for the 32 sending threads: a client per request costs more CPU than the
    # worker spends serving it.
    limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
    with guarded_worker(live_server, loop) as url, httpx.Client(limits=limits) as client:

        def send(index):
            prompt, max_tokens = requests[index]
            body = {"prompt_ids": prompt, "max_tokens": max_tokens, "temperature": 0}
            timeout = 0.05 if index in cancelled else 120
            try:
                response = client.post(f"{url}/v1/completions", json=body, timeout=timeout)
            except httpx.TimeoutException:
                return index, None
            return index, response.json()["choices"][0]["token_ids"]

        swapper = threading.Thread(
            target=_swapper, args=(url, [8, 16, 32, 64], stop, 0.5, swaps), daemon=True
        )
        swapper.start()
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            results = dict(pool.map(send, range(len(requests))))
        stop.set()
        swapper.join()
        for _ in range(200):
            state = loop.state()
            if state["running"] == 0 and state["waiting"] == 0:
                break
            time.sleep(0.05)
    loop.check()
    loop.stop()
    finished = {i: tokens for i, tokens in results.items() if tokens is not None}
    assert len(finished) >= len(requests) - len(cancelled)
    assert all(finished[i] == expected[i].token_ids for i in finished)
    assert state["blocks_used"] == 0
    assert len(finished) < len(requests) and state["cancelled"] > 0  # clients did leave
    print(f"soak: {len(requests) - len(finished)} clients left, {state['cancelled']} cancelled")
    statuses = [s.json()["status"] for s in swaps]
    assert statuses.count("done") >= 2 and set(statuses) <= {"done", "rejected"}


def test_a_faulty_swap_rolls_back_while_traffic_continues(model, live_server):
    requests = _requests(60, seed=9)
    reference = Engine(model, EngineConfig(block_size=8, num_blocks=1024))
    expected = reference.generate(
        [p for p, _ in requests], [SamplingParams(max_tokens=n) for _, n in requests]
    )
    engine = Engine(model, EngineConfig(block_size=8, num_blocks=1024))

    def fault(phase):
        if phase == "copy":
            raise RuntimeError("injected copy fault")

    engine.swap_fault_hook = fault
    loop = EngineLoop(engine)
    loop.start()
    with guarded_worker(live_server, loop) as url:

        def send(index):
            prompt, max_tokens = requests[index]
            body = {"prompt_ids": prompt, "max_tokens": max_tokens, "temperature": 0}
            return httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0][
                "token_ids"
            ]

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(send, i) for i in range(len(requests))]
            swap = httpx.post(
                f"{url}/admin/block-size", json={"block_size": 32}, headers=AUTH, timeout=60
            ).json()
            tokens = [f.result() for f in futures]
    loop.stop()
    assert swap["status"] == "rolled_back" and "injected copy fault" in swap["reason"]
    assert tokens == [o.token_ids for o in expected]
    assert loop.state()["block_size"] == 8
