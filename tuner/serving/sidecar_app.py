"""The sidecar's HTTP API: a FastAPI app around a `Sidecar`.

| endpoint                 | what                                                        |
|--------------------------|-------------------------------------------------------------|
| `POST /v1/observations`  | push finished requests (token; <= 10,000 per call)          |
| `GET /v1/recommendation` | the last decision, the size in force, the next run, a swap  |
| `POST /v1/decide`        | decide now (token)                                          |
| `GET /v1/window`         | the window's statistics and histogram                       |
| `GET /metrics`           | Prometheus exposition (a registry of this app's own)        |
| `GET /healthz`, `/readyz`| alive; scheduler running and a source able to deliver       |

The app's lifespan starts the sidecar and stops it (which saves its state) on
shutdown. Mutating endpoints take the bearer token when one is configured;
`guarded_app` refuses what no client sends (bodies over 1 MiB or not JSON,
foreign origins; see `blocktune.tuner.serving.http`).
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator, Callable, Collection, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from blocktune import __version__
from blocktune.tuner.config.jsonable import to_jsonable
from blocktune.tuner.config.policy import ServerSettings
from blocktune.tuner.serving.http import (
    DETAIL_SCHEMA,
    BearerAuth,
    StrictJsonRoute,
    guarded_app,
    refusals,
    server_config,
)
from blocktune.tuner.sidecar.sidecar import PushDisabled, Sidecar
from blocktune.tuner.sidecar.sources import (
    MAX_OBSERVATIONS,
    InvalidObservations,
    Observation,
    TooManyObservations,
)
from blocktune.tuner.sidecar.stats import SidecarStats

__all__ = ["create_sidecar_app", "router", "serve_sidecar"]


def _observations_body() -> dict:
    item = Observation.model_json_schema()
    items = {"type": "array", "maxItems": MAX_OBSERVATIONS, "items": item}
    wrapped = {
        "type": "object",
        "properties": {"observations": items},
        "required": ["observations"],
        "additionalProperties": False,
    }
    schema = {"anyOf": [items, wrapped]}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


UNAUTHORISED = {401: "a missing or wrong bearer token (when one is configured)"}
_OBSERVATION_REFUSALS = {
    **UNAUTHORISED,
    400: "an empty body, or one that is not standard JSON",
    403: "push is off in this policy (sources.push: false), or a cross-origin request",
    413: "more than 10,000 observations, or a body over 1 MiB",
    422: "an invalid observation: `errors` names each, and nothing was applied",
}


def _json(body: object, status_code: int = 200) -> Response:
    text = json.dumps(to_jsonable(body), allow_nan=False, separators=(",", ":"))
    return Response(text, status_code=status_code, media_type="application/json")


@dataclass(frozen=True)
class _Family:
    """One metric family of the exposition and the stat it reads: a number, or for a
    family with a `label`, (label value, number) pairs in the order shown; None leaves
    the family out."""

    name: str
    help: str
    kind: type[GaugeMetricFamily] | type[CounterMetricFamily]
    read: Callable[[SidecarStats], Any]
    label: str | None = None

    def build(self, value: Any) -> GaugeMetricFamily | CounterMetricFamily:
        if self.label is None:
            return self.kind(self.name, self.help, value=value)
        family = self.kind(self.name, self.help, labels=[self.label])
        for key, number in value:
            family.add_metric([str(key)], number)
        return family


_FAMILIES = (
    _Family(
        "blocktune_recommended_block_size",
        "block size of the last decision (the size to run; equals current when keeping)",
        GaugeMetricFamily,
        lambda s: s.recommended_block_size,
    ),
    _Family(
        "blocktune_current_block_size",
        "block size in force (as reported by the engine, worker or vLLM)",
        GaugeMetricFamily,
        lambda s: s.current_block_size,
    ),
    _Family(
        "blocktune_window_requests",
        "requests in the length window",
        GaugeMetricFamily,
        lambda s: s.window_requests,
    ),
    _Family(
        "blocktune_padding_ratio",
        "padding share of allocated KV slots at each candidate, for the last decision's window",
        GaugeMetricFamily,
        lambda s: sorted(s.padding_ratio.items()),
        label="block_size",
    ),
    _Family(
        "blocktune_decisions",
        "decisions by whether they switch",
        CounterMetricFamily,
        lambda s: sorted(s.decisions.items()),
        label="switch",
    ),
    _Family(
        "blocktune_decision_failures",
        "decision runs that raised",
        CounterMetricFamily,
        lambda s: s.decision_failures,
    ),
    _Family(
        "blocktune_observations",
        "finished requests observed",
        CounterMetricFamily,
        lambda s: s.observations,
    ),
    _Family(
        "blocktune_state_save_failures",
        "state file saves that failed (the last good state stays on disk)",
        CounterMetricFamily,
        lambda s: s.state_save_failures,
    ),
    _Family(
        "blocktune_source_errors",
        "failed polls, bad lines and rejected batches, by source",
        CounterMetricFamily,
        lambda s: sorted(s.source_errors.items()),
        label="source",
    ),
    _Family(
        "blocktune_source_unobserved_polls",
        "polls that saw requests finish on the server but yielded no observation, by source",
        CounterMetricFamily,
        lambda s: sorted(s.source_unobserved_polls.items()),
        label="source",
    ),
    _Family(
        "blocktune_switch_cost_seconds",
        "serving time one switch is priced at (vLLM: the median measured restart, once "
        "one was measured, else the policy's restart)",
        GaugeMetricFamily,
        lambda s: s.switch_cost_s,
    ),
    _Family(
        "blocktune_last_restart_seconds",
        "the last applied restart, from the stop to the new size's /health",
        GaugeMetricFamily,
        lambda s: s.restarts_s[-1] if s.restarts_s else None,
    ),
    _Family(
        "blocktune_engine_mismatches",
        "reports of the engine that disagree with the policy (block size, backend, device)",
        CounterMetricFamily,
        lambda s: sorted(s.engine_mismatches.items()),
        label="kind",
    ),
    _Family(
        "blocktune_swaps",
        "block-size swaps asked of the actuator",
        CounterMetricFamily,
        lambda s: None if s.swaps is None else s.swaps.items(),
        label="status",
    ),
)


class _SidecarMetrics:
    """A prometheus_client collector reading the sidecar's stats at scrape time."""

    def __init__(self, sidecar: Sidecar) -> None:
        self._sidecar = sidecar

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._sidecar.stats()
        for family in _FAMILIES:
            value = family.read(stats)
            if value is not None:
                yield family.build(value)


router = APIRouter(route_class=StrictJsonRoute)
"""The sidecar's routes; each reads the app's `state.sidecar` (and `state.auth`,
`state.registry`), which `create_sidecar_app` sets."""


def _authorised(request: Request) -> None:
    """401 unless the request carries the app's bearer token (when one is configured)."""
    request.app.state.auth(request)


@router.post(
    "/v1/observations",
    dependencies=[Depends(_authorised)],
    openapi_extra=_observations_body(),
    responses=refusals(DETAIL_SCHEMA, _OBSERVATION_REFUSALS),
    summary="Push finished requests into the length window (all or nothing)",
)
async def observations(request: Request) -> Response:
    sidecar: Sidecar = request.app.state.sidecar
    if not await request.body():
        return _json({"detail": "the body is empty: expected a JSON list of observations"}, 400)
    try:
        accepted = sidecar.push(await request.json())  # standard JSON (StrictJsonRoute)
    except PushDisabled as error:
        return _json({"detail": str(error)}, 403)
    except TooManyObservations as error:
        return _json({"detail": str(error), "limit": MAX_OBSERVATIONS}, 413)
    except InvalidObservations as error:
        return _json({"detail": str(error), "errors": error.errors}, 422)
    return _json({"accepted": accepted, "window_requests": len(sidecar.window)})


@router.get("/v1/recommendation", summary="The last decision and the block size in force")
async def recommendation(request: Request) -> Response:
    return _json(request.app.state.sidecar.recommendation())


@router.post(
    "/v1/decide",
    dependencies=[Depends(_authorised)],
    responses=refusals(DETAIL_SCHEMA, {**UNAUTHORISED, 503: "the decision run failed"}),
    summary="Decide now",
)
async def decide(request: Request) -> Response:
    sidecar: Sidecar = request.app.state.sidecar
    decision = await asyncio.to_thread(sidecar.decide)
    if decision is None:
        detail = f"the decision run failed: {sidecar.scheduler.last_error}"
        return _json({"detail": detail}, 503)
    return _json(sidecar.recommendation())


@router.get("/v1/window", summary="Window statistics and histogram")
async def window(request: Request) -> Response:
    return _json(request.app.state.sidecar.window_stats())


@router.get("/metrics", response_class=PlainTextResponse, summary="Prometheus metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/healthz", summary="The process is alive")
async def healthz() -> Response:
    return _json({"status": "ok"})


@router.get(
    "/readyz",
    responses=refusals({"type": "object"}, {503: "not ready: the body says what is missing"}),
    summary="Scheduler running and a source able to deliver",
)
async def readyz(request: Request) -> Response:
    readiness = await asyncio.to_thread(request.app.state.sidecar.readiness)
    return _json(readiness, 200 if readiness["ready"] else 503)


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Start the app's sidecar; stop it (which saves its state) at shutdown."""
    sidecar: Sidecar = app.state.sidecar
    sidecar.start()
    try:
        yield
    finally:
        await asyncio.to_thread(sidecar.stop)


def create_sidecar_app(
    sidecar: Sidecar, *, token: str | None = None, allowed_hosts: Collection[str] = ()
) -> FastAPI:
    """The sidecar's FastAPI app (`router`'s routes); its lifespan starts and stops
    `sidecar`. Requests must name a loopback host or one of `allowed_hosts` (see
    `guarded_app`)."""
    app = guarded_app(
        allowed_hosts=allowed_hosts,
        title="blocktune sidecar",
        version=__version__,
        description="Watches request lengths and decides the KV block size every interval.",
        lifespan=_lifespan,
    )
    registry = CollectorRegistry()
    registry.register(_SidecarMetrics(sidecar))
    app.state.sidecar = sidecar
    app.state.auth = BearerAuth(token)
    app.state.registry = registry
    app.include_router(router)
    return app


def serve_sidecar(
    sidecar: Sidecar, *, host: str, port: int, token: str | None, server: ServerSettings
) -> None:
    """Serve `sidecar` with uvicorn until SIGTERM, SIGINT or SIGHUP, then stop it (which
    saves state and stops a supervised vLLM)."""
    app = create_sidecar_app(sidecar, token=token, allowed_hosts=server.allowed_hosts)
    config = server_config(app, host=host, port=port, server=server)
    uvicorn_server = uvicorn.Server(config)
    # uvicorn shuts down gracefully on SIGTERM/SIGINT and then raises the signal again for
    # the handlers it found; these keep that second delivery from killing the process.
    # SIGHUP (the terminal closed) is a graceful stop too; uvicorn leaves it to us.
    previous = {sig: signal.signal(sig, _shutdown_done) for sig in (signal.SIGTERM, signal.SIGINT)}
    previous[signal.SIGHUP] = signal.signal(
        signal.SIGHUP, lambda _signum, _frame: setattr(uvicorn_server, "should_exit", True)
    )
    try:
        uvicorn_server.run()
    finally:
        sidecar.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _shutdown_done(_signum: int, _frame: object) -> None:
    """The signal was handled by uvicorn's graceful shutdown already."""
