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
Every refusal is an OpenAI error object. Finished request lengths go to a
`LengthPusher`, which posts them to a sidecar in batches from its own thread
and never blocks generation.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Collection, Sequence

import httpx
import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, create_model
from starlette.exceptions import HTTPException as StarletteHTTPException

from blocktune.runtime.engine_loop import EngineLoop, EngineStepFailed
from blocktune.runtime.hot_swap import SwapResult
from blocktune.runtime.requests import FinishedRequest, RequestError
from blocktune.runtime.tokenizer import Tokenizer
from blocktune.tuner.config.policy import ServerSettings
from blocktune.tuner.operations import log_event
from blocktune.tuner.serving.generation import Generation
from blocktune.tuner.serving.http import BearerAuth, guarded_app, refusals, server_config
from blocktune.tuner.serving.openai_api import (
    OPENAI_ERROR_SCHEMA,
    OpenAIError,
    Prepared,
    ServedModel,
)
from blocktune.tuner.serving.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    StreamOptions,
)
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


class BlockSizeRequest(BaseModel):
    """Body of `POST /admin/block-size`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    block_size: int


def _block_size_request(candidates: Sequence[int]) -> type[BlockSizeRequest]:
    """`BlockSizeRequest` whose schema lists the worker's candidates (the sizes `_swap` takes)."""
    sizes = Field(
        description="one of the candidate block sizes", json_schema_extra={"enum": list(candidates)}
    )
    return create_model("BlockSizeRequest", __base__=BlockSizeRequest, block_size=(int, sizes))


# What the OpenAPI document says of each refusal (their bodies are OpenAI error objects).
_GENERATION_REFUSALS = {
    400: "a request the model cannot serve: a token id outside its vocabulary, a prompt and "
    "completion over max_model_len, a text prompt without a tokenizer, echo with logprobs",
    404: "a model other than the one served (code model_not_found)",
    422: "an invalid field, named by param",
    503: "the engine failed a step; the requests in it were dropped",
}
_GENERATION_ANSWERS = {
    200: {
        "description": "the completion; with stream: true, server-sent events of chunks",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {  # each event: data, a chunk as JSON or [DONE]
                "schema": {
                    "type": "object",
                    "properties": {"data": {"type": "string"}},
                    "required": ["data"],
                }
            },
        },
    },
    **refusals(OPENAI_ERROR_SCHEMA, _GENERATION_REFUSALS),
}
_SWAP_REFUSALS = {
    401: "a missing or wrong bearer token (when one is configured)",
    422: "a block size that is not one of the candidates",
    500: "the swap's commit failed; the engine recovered at the old size",
    504: "no step boundary within 60 s",
}


def _json(body: dict, status_code: int = 200, headers: dict | None = None) -> Response:
    # ASCII-escaped, so no text (a lone surrogate included) can break the encoding.
    return Response(
        json.dumps(body, allow_nan=False), status_code, headers, media_type="application/json"
    )


def _sse(body: dict | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body, allow_nan=False)}\n\n"


def _refusal(error: Exception) -> OpenAIError:
    """The error object for an exception that ended an engine job."""
    if isinstance(error, RequestError):
        return OpenAIError(400, str(error))
    return OpenAIError(503, str(error), type="server_error")


def _validation_error(_: Request, error: RequestValidationError) -> Response:
    """422 naming each bad field; the input itself is never echoed (NaN or a lone surrogate
    cannot be written as JSON)."""
    problems = [
        (".".join(str(part) for part in e["loc"] if part != "body") or "body", e["msg"])
        for e in error.errors()
    ]
    message = "; ".join(f"{where}: {what}" for where, what in problems[:5])
    param = problems[0][0] if problems else None
    return _json(OpenAIError(422, message or "invalid request", param=param).body, 422)


def _refusal_body(status: int, message: str) -> dict:
    """A refusal of the guard middlewares as an OpenAI error object."""
    return OpenAIError(status, message).body


def _add_error_handlers(app: FastAPI) -> None:
    """Every refusal in OpenAI's error shape, whatever raised it."""

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, error: OpenAIError) -> Response:
        return _json(error.body, error.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> Response:
        kind = "server_error" if error.status_code >= 500 else "invalid_request_error"
        body = OpenAIError(error.status_code, str(error.detail), type=kind).body
        return _json(body, error.status_code, error.headers)

    app.add_exception_handler(RequestValidationError, _validation_error)


async def _choices(prepared: Prepared, generation: Generation):
    """`(index, text delta, log-probabilities)` of each output, ending choices at stop strings."""
    async for index, output in generation.outputs():
        choice = prepared.choices[index]
        delta = choice.feed(output)
        if choice.finish_reason is not None:
            generation.finish(index, choice.finish_reason)
        yield index, delta, [output.logprob] if output.logprob is not None else []


async def _stream(prepared: Prepared, first: tuple, rest, usage: StreamOptions | None):
    """Server-sent events: a chunk per output that says something (with the usage so far
    under `continuous_usage_stats`), then usage (`include_usage`) and [DONE]."""
    started: set[int] = set()
    continuous = usage is not None and usage.continuous_usage_stats

    def chunk(index: int, delta: str, logprobs: list) -> str:
        is_first = index not in started
        started.add(index)
        return _sse(prepared.chunk(index, delta, logprobs, is_first, continuous))

    yield chunk(*first)
    try:
        async for index, delta, logprobs in rest:
            if delta or logprobs or prepared.choices[index].finish_reason or index not in started:
                yield chunk(index, delta, logprobs)
    except (RequestError, EngineStepFailed) as error:
        yield _sse(_refusal(error).body)
    if usage is not None and usage.include_usage:
        yield _sse(prepared.usage_chunk())
    yield _sse("[DONE]")


async def _drain(items) -> None:
    """Consume an async iterator to its end."""
    async for _ in items:
        continue


async def _unless_gone(work, request: Request) -> None:
    """Await `work`, cancelling it (and so its engine jobs) if the client disconnects."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await asyncio.wait({task}, timeout=0.1)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            raise OpenAIError(499, "client disconnected")
    task.result()


async def _swap(loop: EngineLoop, size: int) -> dict:
    """Swap the engine's block size at its next step boundary: 422 for a size that is not a
    candidate, else the swap's result (done, rejected or rolled back)."""
    candidates = loop.engine.config.candidate_block_sizes
    if size not in candidates:
        raise OpenAIError(
            422,
            f"block_size {size} is not one of this worker's candidate block sizes "
            f"{list(candidates)}",
            param="block_size",
        )
    try:
        result: SwapResult = await asyncio.to_thread(loop.swap, size, 60.0)
    except TimeoutError:
        raise HTTPException(status_code=504, detail="no step boundary within 60 s") from None
    except Exception as error:  # the commit itself failed; the engine loop recovered
        raise HTTPException(status_code=500, detail=f"swap failed: {error}") from None
    log_event(log, "block_size_swap", **result.to_dict())
    return result.to_dict()


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
        refusal_body=_refusal_body,
        refusal_schema=OPENAI_ERROR_SCHEMA,
        title="blocktune worker",
        version="1",
    )
    _add_error_handlers(app)
    auth = BearerAuth(token)
    served = ServedModel(model_name, tokenizer, loop.engine.max_request_tokens)
    metrics = WorkerMetrics(model_name, loop, pusher)

    async def serve(prepared: Prepared, body: CompletionRequest | ChatCompletionRequest, request):
        choices = _choices(prepared, Generation(loop, prepared.jobs, metrics))
        try:
            if body.stream:  # a refusal before the first token is still an HTTP error
                first = await anext(choices)
            else:
                await _unless_gone(_drain(choices), request)
        except (RequestError, EngineStepFailed) as error:
            raise _refusal(error) from None
        if body.stream:
            events = _stream(prepared, first, choices, body.stream_options)
            return StreamingResponse(events, media_type="text/event-stream")
        return _json(prepared.response())

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [served.card()]}

    @app.get(
        "/v1/models/{model_id:path}",
        responses=refusals(
            OPENAI_ERROR_SCHEMA, {404: _GENERATION_REFUSALS[404], 422: "an invalid model id"}
        ),
    )
    async def model(model_id: str) -> dict:
        served.check_model(model_id)
        return served.card()

    @app.post("/v1/completions", responses=_GENERATION_ANSWERS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        prepared = Prepared.completion(body, served)
        return await serve(prepared, body, request)

    @app.post("/v1/chat/completions", responses=_GENERATION_ANSWERS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        prepared = Prepared.chat(body, served)
        return await serve(prepared, body, request)

    async def block_size(body: BlockSizeRequest) -> dict:
        return await _swap(loop, body.block_size)

    # The body's schema lists this worker's candidates (a class made here, so not by name).
    block_size.__annotations__["body"] = _block_size_request(
        loop.engine.config.candidate_block_sizes
    )
    app.post(
        "/admin/block-size",
        dependencies=[Depends(auth)],
        responses=refusals(OPENAI_ERROR_SCHEMA, _SWAP_REFUSALS),
    )(block_size)

    # Both read the state the engine published after its last step: never wait for one.
    @app.get("/admin/state")
    async def state() -> dict:
        return loop.state()

    # Tools probe /metrics and /health with HEAD.
    @app.get("/metrics", response_class=PlainTextResponse)
    @app.head("/metrics", include_in_schema=False)
    async def metrics_endpoint() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get(
        "/health",
        response_class=Response,
        responses={
            200: {"description": "the engine serves (no body)", "content": {}},
            **refusals(OPENAI_ERROR_SCHEMA, {503: "the engine is not running"}),
        },
    )
    @app.head("/health", include_in_schema=False)
    async def health() -> Response:
        """As vLLM answers it: 200 and no body while the engine serves, else 503."""
        if loop.running:
            return Response(status_code=200)
        raise OpenAIError(503, "the engine is not running", type="server_error")

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
