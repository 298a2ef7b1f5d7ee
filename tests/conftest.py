"""Shared fixtures: a real uvicorn server, configured as the services are, on a free port;
a sharded replay; a deployment whose block size matters both ways; a random Llama saved by
transformers; a bundled policy pinned to the analytic calibration."""

import contextlib
import threading
import time
from pathlib import Path

import pytest
import torch
import uvicorn

from blocktune.tuner.config.calibration import ANALYTIC_FILE, bundled_files
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


@pytest.fixture(scope="session")
def save_random_llama():
    """`save_random_llama(folder, **config)`: a transformers Llama of 2 layers, 64 wide, with 4
    query and 2 KV heads (weights seeded 0, `config` on top), saved as safetensors in `folder`;
    returns the model, in eval mode."""
    transformers = pytest.importorskip("transformers")

    def save(folder, **config):
        shape = dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape | config)).eval()
        model.save_pretrained(folder, safe_serialization=True)
        return model

    return save


@pytest.fixture(scope="session")
def analytic_policy_file(tmp_path_factory):
    """`analytic_policy_file(name)`: the path of `policies/<name>.yaml` pinned to the bundled
    analytic calibration, so that a measured file bundled later cannot change what a test
    expects."""
    analytic = next(path for path in bundled_files() if path.name == ANALYTIC_FILE)
    policies = Path(__file__).resolve().parents[1] / "policies"

    def pinned(name: str) -> str:
        text = (policies / f"{name}.yaml").read_text(encoding="utf-8")
        pinned = text.replace("calibration: default", f"calibration: {analytic}")
        assert pinned != text, f"{name}.yaml names no default calibration"
        path = tmp_path_factory.mktemp("policy") / f"{name}_analytic.yaml"
        path.write_text(pinned, encoding="utf-8")
        return str(path)

    return pinned
