"""The worker's admin and ops routes: block-size swaps, engine state, metrics, health.

Each handler reads its app's state: `loop` (the `EngineLoop`) and `metrics`
(the `WorkerMetrics`). `router` holds the routes every worker shares; the
swap's route is made per app by `block_size_router`, since its body's schema
lists that worker's candidate block sizes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, create_model

from blocktune.runtime.hot_swap import SwapResult
from blocktune.tuner.operations import log_event
from blocktune.tuner.serving.http import BearerAuth, StrictJsonRoute, refusals
from blocktune.tuner.serving.openai_api import OPENAI_ERROR_SCHEMA, OpenAIError

__all__ = ["BlockSizeRequest", "block_size_router", "router", "swap_block_size"]

log = logging.getLogger("blocktune.worker")

SWAP_TIMEOUT_S = 60.0
_SWAP_REFUSALS = {
    401: "a missing or wrong bearer token (when one is configured)",
    422: "a block size that is not one of the candidates",
    500: "the swap's commit failed; the engine recovered at the old size",
    504: f"no step boundary within {SWAP_TIMEOUT_S:.0f} s",
}

router = APIRouter(route_class=StrictJsonRoute)


class BlockSizeRequest(BaseModel):
    """Body of `POST /admin/block-size`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    block_size: int


def _block_size_request(candidates: Sequence[int]) -> type[BlockSizeRequest]:
    """`BlockSizeRequest` whose schema lists the worker's candidates (the sizes a swap takes)."""
    sizes = Field(
        description="one of the candidate block sizes", json_schema_extra={"enum": list(candidates)}
    )
    return create_model("BlockSizeRequest", __base__=BlockSizeRequest, block_size=(int, sizes))


async def swap_block_size(body: BlockSizeRequest, request: Request) -> dict:
    """Swap the engine's block size at its next step boundary: 422 for a size that is not a
    candidate, else the swap's result (done, rejected or rolled back)."""
    loop = request.app.state.loop
    size = body.block_size
    candidates = loop.engine.config.candidate_block_sizes
    if size not in candidates:
        raise OpenAIError(
            422,
            f"block_size {size} is not one of this worker's candidate block sizes "
            f"{list(candidates)}",
            param="block_size",
        )
    try:
        result: SwapResult = await asyncio.to_thread(loop.swap, size, SWAP_TIMEOUT_S)
    except TimeoutError:
        raise HTTPException(status_code=504, detail=_SWAP_REFUSALS[504]) from None
    except Exception as error:  # the commit itself failed; the engine loop recovered
        raise HTTPException(status_code=500, detail=f"swap failed: {error}") from None
    log_event(log, "block_size_swap", **result.to_dict())
    return result.to_dict()


def block_size_router(candidates: Sequence[int], auth: BearerAuth) -> APIRouter:
    """`POST /admin/block-size` (`swap_block_size`) behind `auth`, its body's schema listing
    `candidates`."""

    async def block_size(body: BlockSizeRequest, request: Request) -> dict:
        return await swap_block_size(body, request)

    # The body class is made here, so it cannot be named in the signature.
    block_size.__annotations__["body"] = _block_size_request(candidates)
    per_app = APIRouter(route_class=StrictJsonRoute)
    per_app.post(
        "/admin/block-size",
        dependencies=[Depends(auth)],
        responses=refusals(OPENAI_ERROR_SCHEMA, _SWAP_REFUSALS),
    )(block_size)
    return per_app


# Both read the state the engine published after its last step: never wait for one.
@router.get("/admin/state")
async def state(request: Request) -> dict:
    return request.app.state.loop.state()


# Tools probe /metrics and /health with HEAD: both methods are served and documented.
_METRICS = {"response_class": PlainTextResponse}
_HEALTH = {
    "response_class": Response,
    "responses": {
        200: {"description": "the engine serves (no body)", "content": {}},
        **refusals(OPENAI_ERROR_SCHEMA, {503: "the engine is not running"}),
    },
}


@router.get("/metrics", **_METRICS)
@router.head("/metrics", **_METRICS)
async def metrics_endpoint(request: Request) -> Response:
    return Response(request.app.state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


@router.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/health", **_HEALTH)
@router.head("/health", **_HEALTH)
async def health(request: Request) -> Response:
    """As vLLM answers it: 200 and no body while the engine serves, else 503."""
    if request.app.state.loop.running:
        return Response(status_code=200)
    raise OpenAIError(503, "the engine is not running", type="server_error")
