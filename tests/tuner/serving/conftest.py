"""Fixtures of the worker's API tests: a loaded model (tiny-random unless a module overrides
`loaded`), a worker serving it on loopback (`serve_worker`), and the official `openai` client
on the module's `worker`."""

import contextlib

import pytest

from blocktune.runtime.engine import Engine
from blocktune.runtime.engine_loop import EngineLoop
from blocktune.runtime.loading import load_pretrained
from blocktune.tuner.serving.worker_app import create_worker_app


@pytest.fixture(scope="module")
def loaded():
    """The tiny-random model and its byte-level tokenizer, loaded once per module."""
    return load_pretrained("tiny-random")


@pytest.fixture
def serve_worker(live_server):
    """`with serve_worker(loaded, config, model_name) as url:` runs a worker whose engine
    loop serves `loaded` with `config`; the loop stops when the block ends."""

    @contextlib.contextmanager
    def serve(loaded, config, model_name):
        loop = EngineLoop(Engine(loaded.model, config))
        loop.start()
        try:
            app = create_worker_app(loop, model_name=model_name, tokenizer=loaded.tokenizer)
            with live_server(app) as url:
                yield url
        finally:
            loop.stop()

    return serve


@pytest.fixture
def client(worker):
    """The official `openai` client on the module's `worker` URL, without retries."""
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=f"{worker}/v1", api_key="unused", max_retries=0) as client:
        yield client
