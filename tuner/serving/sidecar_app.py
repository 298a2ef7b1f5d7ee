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
from collections.abc import AsyncIterator, Collection
from contextlib import asynccontextmanager

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from blocktune import __version__
from blocktune.tuner.config.jsonable import to_jsonable
from blocktune.tuner.config.policy import ServerSettings
from blocktune.tuner.serving.http import (
    DETAIL_SCHEMA,
    BearerAuth,
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

__all__ = ["create_sidecar_app", "serve_sidecar"]


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


class _SidecarMetrics:
    """A prometheus_client collector reading the sidecar at scrape time."""

    def __init__(self, sidecar: Sidecar) -> None:
        self._sidecar = sidecar

    def collect(self):
        m = self._sidecar.metrics()
        if m["recommended_block_size"] is not None:
            yield GaugeMetricFamily(
                "blocktune_recommended_block_size",
                "block size of the last decision (the size to run; equals current when keeping)",
                value=m["recommended_block_size"],
            )
        yield GaugeMetricFamily(
            "blocktune_current_block_size",
            "block size in force (as reported by the engine, worker or vLLM)",
            value=m["current_block_size"],
        )
        yield GaugeMetricFamily(
            "blocktune_window_requests", "requests in the length window", value=m["window_requests"]
        )
        padding = GaugeMetricFamily(
            "blocktune_padding_ratio",
            "padding share of allocated KV slots at each candidate, for the last decision's window",
            labels=["block_size"],
        )
        for size, ratio in sorted(m["padding_ratio"].items()):
            padding.add_metric([str(size)], ratio)
        yield padding
        decisions = CounterMetricFamily(
            "blocktune_decisions", "decisions by whether they switch", labels=["switch"]
        )
        for switch, count in sorted(m["decisions"].items()):
            decisions.add_metric([switch], count)
        yield decisions
        yield CounterMetricFamily(
            "blocktune_decision_failures",
            "decision runs that raised",
            value=m["decision_failures"],
        )
        yield CounterMetricFamily(
            "blocktune_observations", "finished requests observed", value=m["observations"]
        )
        yield CounterMetricFamily(
            "blocktune_state_save_failures",
            "state file saves that failed (the last good state stays on disk)",
            value=m["state_save_failures"],
        )
        errors = CounterMetricFamily(
            "blocktune_source_errors",
            "failed polls, bad lines and rejected batches, by source",
            labels=["source"],
        )
        for source, count in sorted(m["source_errors"].items()):
            errors.add_metric([source], count)
        yield errors
        unobserved = CounterMetricFamily(
            "blocktune_source_unobserved_polls",
            "polls that saw requests finish on the server but yielded no observation, by source",
            labels=["source"],
        )
        for source, count in sorted(m["source_unobserved_polls"].items()):
            unobserved.add_metric([source], count)
        yield unobserved
        yield GaugeMetricFamily(
            "blocktune_switch_cost_seconds",
            "serving time one switch is priced at (vLLM: the median measured restart, once "
            "one was measured, else the policy's restart)",
            value=m["switch_cost_s"],
        )
        if m["restarts_s"]:
            yield GaugeMetricFamily(
                "blocktune_last_restart_seconds",
                "the last applied restart, from the stop to the new size's /health",
                value=m["restarts_s"][-1],
            )
        mismatches = CounterMetricFamily(
            "blocktune_engine_mismatches",
            "reports of the engine that disagree with the policy (block size, backend, device)",
            labels=["kind"],
        )
        for kind, count in sorted(m["engine_mismatches"].items()):
            mismatches.add_metric([kind], count)
        yield mismatches
        if m["swaps"] is not None:
            swaps = CounterMetricFamily(
                "blocktune_swaps", "block-size swaps asked of the actuator", labels=["status"]
            )
            for status, count in m["swaps"].items():
                swaps.add_metric([status], count)
            yield swaps


def create_sidecar_app(
    sidecar: Sidecar, *, token: str | None = None, allowed_hosts: Collection[str] = ()
) -> FastAPI:
    """The sidecar's FastAPI app; its lifespan starts and stops `sidecar`. Requests must
    name a loopback host or one of `allowed_hosts` (see `guarded_app`)."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        sidecar.start()
        try:
            yield
        finally:
            await asyncio.to_thread(sidecar.stop)

    app = guarded_app(
        allowed_hosts=allowed_hosts,
        title="blocktune sidecar",
        version=__version__,
        description="Watches request lengths and decides the KV block size every interval.",
        lifespan=lifespan,
    )
    auth = BearerAuth(token)
    registry = CollectorRegistry()
    registry.register(_SidecarMetrics(sidecar))

    @app.post(
        "/v1/observations",
        dependencies=[Depends(auth)],
        openapi_extra=_observations_body(),
        responses=refusals(DETAIL_SCHEMA, _OBSERVATION_REFUSALS),
        summary="Push finished requests into the length window (all or nothing)",
    )
    async def observations(request: Request) -> Response:
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

    @app.get("/v1/recommendation", summary="The last decision and the block size in force")
    async def recommendation() -> Response:
        return _json(sidecar.recommendation())

    @app.post(
        "/v1/decide",
        dependencies=[Depends(auth)],
        responses=refusals(DETAIL_SCHEMA, {**UNAUTHORISED, 503: "the decision run failed"}),
        summary="Decide now",
    )
    async def decide() -> Response:
        decision = await asyncio.to_thread(sidecar.decide)
        if decision is None:
            detail = f"the decision run failed: {sidecar.scheduler.last_error}"
            return _json({"detail": detail}, 503)
        return _json(sidecar.recommendation())

    @app.get("/v1/window", summary="Window statistics and histogram")
    async def window() -> Response:
        return _json(sidecar.window_stats())

    @app.get("/metrics", response_class=PlainTextResponse, summary="Prometheus metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz", summary="The process is alive")
    async def healthz() -> Response:
        return _json({"status": "ok"})

    @app.get(
        "/readyz",
        responses=refusals({"type": "object"}, {503: "not ready: the body says what is missing"}),
        summary="Scheduler running and a source able to deliver",
    )
    async def readyz() -> Response:
        readiness = await asyncio.to_thread(sidecar.readiness)
        return _json(readiness, 200 if readiness["ready"] else 503)

    return app


def serve_sidecar(
    sidecar: Sidecar, *, host: str, port: int, token: str | None, server: ServerSettings
) -> None:
    """Serve `sidecar` with uvicorn until SIGTERM/SIGINT, then stop it (which saves state)."""
    app = create_sidecar_app(sidecar, token=token, allowed_hosts=server.allowed_hosts)
    config = server_config(app, host=host, port=port, server=server)
    # uvicorn shuts down gracefully on SIGTERM/SIGINT and then raises the signal again for
    # the handlers it found; these keep that second delivery from killing the process.
    previous = {sig: signal.signal(sig, _shutdown_done) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        uvicorn.Server(config).run()
    finally:
        sidecar.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _shutdown_done(_signum: int, _frame: object) -> None:
    """The signal was handled by uvicorn's graceful shutdown already."""
