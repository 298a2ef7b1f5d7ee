"""The engine as an HTTP worker: completions, live block-size swaps, metrics.

One thread (`EngineLoop`) owns the engine and runs its steps; HTTP handlers
hand requests, cancellations and swap requests to it and wait for the answer,
so concurrent requests share the engine through continuous batching. Finished
request lengths go to a `LengthPusher`, which posts them to a sidecar in
batches from its own thread and never blocks generation.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque

import httpx
import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field, model_validator

from blocktune.runtime.engine import (
    FinishedRequest,
    RequestError,
    RequestOutput,
    SamplingParams,
)
from blocktune.runtime.engine_loop import EngineLoop
from blocktune.runtime.hot_swap import SwapResult
from blocktune.tuner.core.policy import ServerSettings
from blocktune.tuner.operations import log_event
from blocktune.tuner.serving.http import BearerAuth, guarded_app, server_config

__all__ = ["CompletionRequest", "LengthPusher", "create_worker_app", "serve_worker"]

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


class CompletionRequest(BaseModel):
    """A completion: token ids (or a byte-level `prompt` string) and sampling settings."""

    model_config = ConfigDict(extra="forbid")

    prompt_ids: list[int] | None = None
    prompt: str | None = None
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop_token_ids: list[int] = []

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        if (self.prompt_ids is None) == (self.prompt is None):
            raise ValueError("give exactly one of prompt_ids and prompt")
        return self

    def token_ids(self) -> list[int]:
        if self.prompt_ids is not None:
            return self.prompt_ids
        return list(self.prompt.encode("utf-8"))


class BlockSizeRequest(BaseModel):
    """Body of `POST /admin/block-size`."""

    model_config = ConfigDict(extra="forbid")

    block_size: int


class _EngineMetrics:
    """A prometheus_client collector reading the engine loop's state at scrape time."""

    def __init__(self, loop: EngineLoop, pusher: LengthPusher | None) -> None:
        self._loop = loop
        self._pusher = pusher

    def collect(self):
        state = self._loop.state()
        gauges = {
            "block_size": "KV block size in tokens",
            "running": "requests being decoded",
            "waiting": "requests waiting for blocks",
            "blocks_used": "KV blocks in use",
            "blocks_free": "KV blocks free (including evictable cached blocks)",
            "padding_slots": "allocated but unused KV slots",
            "last_swap_pause_s": "pause of the last block-size swap in seconds",
        }
        for name, help_text in gauges.items():
            yield GaugeMetricFamily(f"blocktune_worker_{name}", help_text, value=state[name])
        counters = {
            "preemptions": "requests preempted for recompute",
            "completed": "completions finished",
            "cancelled": "completions cancelled (client gone)",
            "rejected": "completions rejected as invalid",
            "swap_bytes_moved": "bytes copied by block-size swaps",
        }
        for name, help_text in counters.items():
            yield CounterMetricFamily(f"blocktune_worker_{name}", help_text, value=state[name])
        swaps = CounterMetricFamily(
            "blocktune_worker_swaps", "block-size swaps by outcome", labels=["status"]
        )
        for status in ("done", "rejected", "rolled_back"):
            swaps.add_metric([status], state[f"swaps_{status}"])
        yield swaps
        if self._pusher is not None:
            yield CounterMetricFamily(
                "blocktune_worker_lengths_dropped",
                "finished lengths dropped because the sidecar backlog was full",
                value=self._pusher.dropped,
            )
            yield GaugeMetricFamily(
                "blocktune_worker_lengths_backlog",
                "finished lengths waiting to be pushed to the sidecar",
                value=self._pusher.backlog(),
            )


def _resolve(future: asyncio.Future, outcome: object) -> None:
    if not future.done():
        future.set_result(outcome)


def create_worker_app(
    loop: EngineLoop, *, token: str | None = None, pusher: LengthPusher | None = None
) -> FastAPI:
    """The worker's FastAPI app around a started `EngineLoop`."""
    app = guarded_app(token=token, title="blocktune worker", version="1")
    auth = BearerAuth(token)
    registry = CollectorRegistry()
    registry.register(_EngineMetrics(loop, pusher))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> dict:
        loop_ = asyncio.get_running_loop()
        future: asyncio.Future = loop_.create_future()

        def done(outcome: RequestOutput | Exception) -> None:
            loop_.call_soon_threadsafe(_resolve, future, outcome)

        prompt = body.token_ids()
        params = SamplingParams(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            stop_token_ids=tuple(body.stop_token_ids),
        )
        job = loop.submit(prompt, params, done)
        while True:
            finished, _ = await asyncio.wait({future}, timeout=0.1)
            if finished:
                break
            if await request.is_disconnected():
                loop.cancel(job)
                raise HTTPException(status_code=499, detail="client disconnected")
        outcome = future.result()
        if isinstance(outcome, RequestError):
            raise HTTPException(status_code=400, detail=str(outcome))
        if isinstance(outcome, Exception):
            raise HTTPException(status_code=503, detail=str(outcome))
        return {
            "id": f"cmpl-{outcome.request_id}",
            "token_ids": outcome.token_ids,
            "finish_reason": outcome.finish_reason,
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(outcome.token_ids)},
        }

    @app.post("/admin/block-size", dependencies=[Depends(auth)])
    async def block_size(body: BlockSizeRequest) -> dict:
        ticket = loop.request_block_size(body.block_size)
        try:
            result: SwapResult = await asyncio.to_thread(ticket.result, 60.0)
        except TimeoutError:
            raise HTTPException(status_code=504, detail="no step boundary within 60 s") from None
        except Exception as error:  # the commit itself failed; the engine loop recovered
            raise HTTPException(status_code=500, detail=f"swap failed: {error}") from None
        log_event(log, "block_size_swap", **result.to_dict())
        return result.to_dict()

    @app.get("/admin/state")
    async def state() -> dict:
        return loop.state()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    return app


def serve_worker(
    loop: EngineLoop,
    *,
    host: str,
    port: int,
    token: str | None,
    pusher: LengthPusher | None,
    server: ServerSettings,
) -> None:
    """Start `loop` and serve it with uvicorn until SIGINT/SIGTERM, then stop both threads."""
    loop.start()
    app = create_worker_app(loop, token=token, pusher=pusher)
    try:
        uvicorn.Server(server_config(app, host=host, port=port, server=server)).run()
    finally:
        loop.stop()
        if pusher is not None:
            pusher.stop()
