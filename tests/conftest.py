"""Shared fixtures: a real uvicorn server, configured as the services are, on a free port;
a sharded replay; a deployment whose block size matters both ways."""

import contextlib
import threading
import time

import pytest
import uvicorn

from blocktune.tuner.config.policy import Policy, ServerSettings, load_policy
from blocktune.tuner.operations import free_port
from blocktune.tuner.serving.http import server_config


@contextlib.contextmanager
def serving(app, settings: ServerSettings = ServerSettings()):  # noqa: B008 - frozen
    """Serve an ASGI app with uvicorn in a thread (the services' configuration with
    `settings`' connection limits); yields its base URL."""
    port = free_port()
    server = uvicorn.Server(server_config(app, host="127.0.0.1", port=port, server=settings))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture
def live_server():
    """`with live_server(app) as url:` runs the app on loopback for the test."""
    return serving


def sharded_report(plan, count: int):
    """The report of `plan` replayed here in `count` time shards, each with its warm-up."""
    from blocktune.tuner.replay.runner import ORACLE
    from blocktune.tuner.replay.shards import merge_shards, time_shards

    shards = time_shards(plan, count)

    def merged(play, *args):
        parts = [play(shard.plan(plan), *args) for shard in shards]
        alone = [None] + [play(shard.warmup_plan(plan), *args) for shard in shards[1:]]
        return merge_shards(plan, shards, parts, alone)

    played = {name: merged(type(plan).play, name) for name in plan.names[:-1]}
    played[ORACLE] = merged(type(plan).play_oracle, plan.oracle_schedule(played))
    return plan.report(played)


@pytest.fixture
def replay_in_shards():
    """`replay_in_shards(plan, count)`: the report of a sharded replay in this process."""
    return sharded_report


@pytest.fixture
def llama2_7b_policy() -> Policy:
    """The customer-service policy for a Llama-2-7B shape with 3 GiB of KV (6144 slots) and
    512 sequences a step, deciding every 15 s. Without grouped-query attention its K and V
    take 512 KiB per token, so reading the pool weighs against reading the weights: long
    requests serve best in larger blocks (fewer block-table entries), very short ones at 8
    (less padding, more of them fit)."""
    base = load_policy("customer_service_llama8b")
    shape = {"num_heads": 32, "num_kv_heads": 32, "num_params": 6.74e9}
    return Policy.model_validate(
        {
            **base.model_dump(),
            "model": {**base.model.model_dump(), **shape},
            "kv_budget": "3GiB",
            "batch": {"max_num_seqs": 512},
            "interval": "15s",
            "min_dwell": "2m",
        }
    )
