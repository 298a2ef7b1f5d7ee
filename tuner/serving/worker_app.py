"""The engine as an HTTP worker: OpenAI-compatible completions, live block-size swaps, metrics.

| endpoint | what |
| --- | --- |
| `GET /v1/models` (`/v1/models/{id}`) | the model served |
| `POST /v1/completions` | text or token-id prompts; streams server-sent events with `stream` |
| `POST /v1/chat/completions` | messages in the model's chat template; streams too |
| `POST /admin/block-size` | swap the KV block size at the next step boundary (token) |
| `GET /admin/state`, `/metrics` | engine state, Prometheus (vLLM's names and blocktune's) |
| `GET /health`, `/healthz` | vLLM's health check (503 when the engine is down), liveness |

One thread (`EngineLoop`) owns the engine and runs its steps; HTTP handlers
hand it requests, cancellations and swap requests, and stream its outputs
back, so concurrent requests share the engine through continuous batching.
The handlers are those of `openai_routes` and `admin_routes`, which read the
engine loop, the served model and the metrics from the app's state; every
refusal is an OpenAI error object (`worker_errors`). Finished request lengths go to a
`LengthPusher`, which posts them to a sidecar in batches from its own thread
and never blocks generation.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Collection

import httpx
import uvicorn
from fastapi import FastAPI

from blocktune.runtime.engine_loop import EngineLoop
from blocktune.runtime.requests import FinishedRequest
from blocktune.runtime.tokenizer import Tokenizer
from blocktune.tuner.config.policy import ServerSettings
from blocktune.tuner.operations import log_event
from blocktune.tuner.serving import admin_routes, openai_routes
from blocktune.tuner.serving.http import BearerAuth, guarded_app, server_config
from blocktune.tuner.serving.openai_api import OPENAI_ERROR_SCHEMA, ServedModel
from blocktune.tuner.serving.worker_errors import add_error_handlers, refusal_body
from blocktune.tuner.serving.worker_metrics import WorkerMetrics

__all__ = ["LengthPusher", "create_worker_app", "serve_worker"]

log = logging.getLogger("blocktune.worker")


class LengthPusher:
    """Posts finished request lengths to a sidecar in batches, from its own thread.

    The backlog is bounded: when the sidecar is down for long, the oldest
    lengths are dropped and counted. Failures back off exponentially.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        batch_size: int = 100,
        max_backlog: int = 10_000,
        flush_interval_s: float = 0.5,
        max_backoff_s: float = 30.0,
    ) -> None:
        self.url = url.rstrip("/") + "/v1/observations"
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        # (sequence number, observation): after a POST, exactly the items sent are removed,
        # even if the oldest were dropped for room while it was in flight.
        self._backlog: deque[tuple[int, dict]] = deque()
        self._numbers = itertools.count()
        self._lock = threading.Lock()
        self._batch_size = batch_size
        self._max_backlog = max_backlog
        self._flush_interval_s = flush_interval_s
        self._max_backoff_s = max_backoff_s
        self._stop = threading.Event()
        self.sent = 0
        self.dropped = 0
        self.failures = 0
        self._thread = threading.Thread(target=self._run, name="length-pusher", daemon=True)

    def observe(self, record: FinishedRequest) -> None:
        """Engine listener: queue one finished request (never blocks on the network)."""
        item = {
            "prompt_tokens": record.prompt_tokens,
            "output_tokens": record.output_tokens,
            "timestamp": time.time(),
        }
        with self._lock:
            if len(self._backlog) >= self._max_backlog:
                self._backlog.popleft()
                self.dropped += 1
            self._backlog.append((next(self._numbers), item))

    def backlog(self) -> int:
        with self._lock:
            return len(self._backlog)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        backoff = self._flush_interval_s
        with httpx.Client(timeout=5.0) as client:
            while not self._stop.wait(backoff):
                backoff = self._flush_interval_s
                while True:
                    with self._lock:
                        batch = list(itertools.islice(self._backlog, self._batch_size))
                    if not batch:
                        break
                    body = [item for _, item in batch]
                    try:
                        response = client.post(self.url, json=body, headers=self._headers)
                        response.raise_for_status()
                    except httpx.HTTPError as error:
                        self.failures += 1
                        backoff = min(self._max_backoff_s, backoff * 2 ** min(self.failures, 6))
                        log_event(log, "sidecar_push_failed", error=str(error), backlog=len(batch))
                        break
                    last_sent = batch[-1][0]
                    with self._lock:
                        while self._backlog and self._backlog[0][0] <= last_sent:
                            self._backlog.popleft()
                    self.sent += len(batch)
                    self.failures = 0


def create_worker_app(
    loop: EngineLoop,
    *,
    model_name: str,
    tokenizer: Tokenizer | None,
    token: str | None = None,
    pusher: LengthPusher | None = None,
    allowed_hosts: Collection[str] = (),
) -> FastAPI:
    """The worker's FastAPI app around a started `EngineLoop` serving `model_name`, for
    requests naming a loopback host or one of `allowed_hosts` (see `guarded_app`)."""
    app = guarded_app(
        allowed_hosts=allowed_hosts,
        refusal_body=refusal_body,
        refusal_schema=OPENAI_ERROR_SCHEMA,
        title="blocktune worker",
        version="1",
    )
    add_error_handlers(app)
    app.state.loop = loop
    app.state.served = ServedModel(model_name, tokenizer, loop.engine.max_request_tokens)
    app.state.metrics = WorkerMetrics(model_name, loop, pusher)
    app.include_router(openai_routes.router)
    candidates = loop.engine.config.candidate_block_sizes
    app.include_router(admin_routes.block_size_router(candidates, BearerAuth(token)))
    app.include_router(admin_routes.router)
    return app


def serve_worker(
    loop: EngineLoop,
    *,
    model_name: str,
    tokenizer: Tokenizer | None,
    host: str,
    port: int,
    token: str | None,
    pusher: LengthPusher | None,
    server: ServerSettings,
) -> None:
    """Start `loop` and serve it with uvicorn until SIGINT/SIGTERM, then stop both threads."""
    loop.start()
    app = create_worker_app(
        loop,
        model_name=model_name,
        tokenizer=tokenizer,
        token=token,
        pusher=pusher,
        allowed_hosts=server.allowed_hosts,
    )
    try:
        uvicorn.Server(server_config(app, host=host, port=port, server=server)).run()
    finally:
        loop.stop()
        if pusher is not None:
            pusher.stop()
