"""What blocktune's HTTP services share: the guarded app, auth, safe binding, the server.

Both the sidecar and the worker are FastAPI apps made by `guarded_app` and
served with `server_config`. Before a route sees a request:

- a body over `MAX_BODY_BYTES` is refused with 413 before it is read whole;
- a `Host` header that is not RFC 9110's `host[:port]` (userinfo such as
  `evil.example@127.0.0.1` included), or names neither a loopback host nor
  one of the allowed hosts, is refused with 421, token or not, so no page of
  a rebound DNS name can read the API (a deployment behind a proxy names the
  hosts its clients use: `server.allowed_hosts`, `--allowed-host`);
- a body not declared `Content-Type: application/json` is refused with 415,
  and a request whose `Origin` is not its own host with 403, so no web page
  open on the host can drive the API;
- a body that is not standard JSON (NaN, Infinity, invalid UTF-8, a lone
  surrogate, nesting over 200 levels) is a 400 naming the line and column;
- a 422 names every invalid field and echoes a value only when it is JSON.

The refusals of the two middlewares are shaped by the app's `refusal_body`
(`{"detail": ...}` by default; the worker's are OpenAI error objects), and
every operation of the app's OpenAPI document lists them (`refusals`).

Mutating endpoints require `Authorization: Bearer <token>` when a token is
configured (compared in constant time); without a token a service refuses to
bind anything but a loopback address. uvicorn closes a connection that has
not delivered a whole request (head and body) within the policy's
`server.read_timeout` of opening or of its last answer, an idle one after
`server.keep_alive`, and any beyond `server.max_connections` at once.
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
import json
import re
from collections.abc import Callable, Collection, Coroutine
from typing import Any
from urllib.parse import urlsplit

import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from blocktune.tuner.config.config_files import clip
from blocktune.tuner.config.jsonable import from_json
from blocktune.tuner.config.policy import ServerSettings

__all__ = [
    "DETAIL_SCHEMA",
    "MAX_BODY_BYTES",
    "BearerAuth",
    "BodyLimit",
    "InsecureBind",
    "RefusalBody",
    "RequestGuard",
    "check_bind",
    "detail_body",
    "guarded_app",
    "host_name",
    "refusals",
    "server_config",
]

MAX_BODY_BYTES = 1 << 20
# RFC 9110's Host: uri-host [":" port], uri-host an IP-literal, IPv4address or reg-name
# (RFC 3986: unreserved, pct-encoded and sub-delims; no userinfo, no path).
_HOST_HEADER = re.compile(
    r"(?P<host>\[[0-9A-Fa-f:.]+\]|(?:[A-Za-z0-9._~!$&'()*+,;=-]|%[0-9A-Fa-f]{2})+)(?::[0-9]*)?"
)

RefusalBody = Callable[[int, str], dict]
DETAIL_SCHEMA = {"type": "object", "properties": {"detail": {}}, "required": ["detail"]}
# The refusals any request may meet before its route sees it.
GUARD_REFUSALS = {
    400: "the body is not standard JSON",
    403: "a cross-origin request",
    413: "a body over 1 MiB",
    415: "a body not declared application/json",
    421: "a Host header that is no host[:port], or names no loopback or allowed host",
}


def refusals(schema: dict, described: dict[int, str]) -> dict[int | str, dict]:
    """OpenAPI `responses` for the refusals in `described` (status -> why), each a JSON
    body of `schema`."""
    return {
        status: {"description": why, "content": {"application/json": {"schema": schema}}}
        for status, why in described.items()
    }


def detail_body(_status: int, message: str) -> dict:
    """A refusal as FastAPI words its own: `{"detail": message}`."""
    return {"detail": message}


def host_name(header: str) -> str | None:
    """The host of a `Host` header (lower case, an IPv6 address without its brackets), or
    None when the header is no RFC 9110 `host[:port]`."""
    match = _HOST_HEADER.fullmatch(header)
    if match is None:
        return None
    host = match["host"].lower()
    if host.startswith("["):
        try:
            return str(ipaddress.IPv6Address(host[1:-1]))
        except ValueError:
            return None
    return host


class InsecureBind(ValueError):
    """A non-loopback address without a token to protect the mutating endpoints."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None) -> None:
    """Refuse to serve a non-loopback address when no token is configured."""
    if token is None and not is_loopback(host):
        raise InsecureBind(
            f"refusing to bind {host}: no bearer token is configured (set the token "
            "environment variable named by the policy, or bind 127.0.0.1)"
        )


class BearerAuth:
    """A FastAPI dependency: 401 unless the request carries the configured bearer token."""

    def __init__(self, token: str | None) -> None:
        self._token = token

    def __call__(self, request: Request) -> None:
        if self._token is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode(), self._token.encode()
        ):
            raise HTTPException(
                status_code=401,
                detail="missing or wrong bearer token",
                headers={"WWW-Authenticate": "Bearer"},
            )


class BodyLimit:
    """ASGI middleware: refuse request bodies over `max_bytes` with 413.

    A declared Content-Length over the limit is refused at once; a body that
    grows past it while streaming fails the read with the same 413.
    """

    def __init__(
        self, app, max_bytes: int = MAX_BODY_BYTES, refusal_body: RefusalBody = detail_body
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.refusal_body = refusal_body

    def _too_large(self) -> HTTPException:
        return HTTPException(
            status_code=413, detail=f"request body over the limit of {self.max_bytes} bytes"
        )

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            body = self.refusal_body(413, self._too_large().detail)
            await JSONResponse(body, status_code=413)(scope, receive, send)
            return
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._too_large()
            return message

        await self.app(scope, limited_receive, send)


class RequestGuard:
    """ASGI middleware: refuse, from the headers alone, what no client of ours sends.

    The `Host` must be a `host[:port]` naming a loopback host or one of
    `allowed_hosts` (421), an `Origin` header must name the request's own host
    (403), and a body must be declared `application/json` (415).
    """

    def __init__(
        self,
        app,
        *,
        allowed_hosts: Collection[str] = (),
        refusal_body: RefusalBody = detail_body,
    ) -> None:
        self.app = app
        self.allowed_hosts = frozenset(host.lower() for host in allowed_hosts)
        self.refusal_body = refusal_body

    def _host_refusal(self, host: str) -> str | None:
        name = host_name(host)
        if name is None:
            return f"the Host header {_shown(host)} is not a host[:port]"
        if not (is_loopback(name) or name in self.allowed_hosts):
            return (
                f"host {_shown(host)} is neither loopback nor an allowed host "
                "(name the hosts clients use with server.allowed_hosts or --allowed-host)"
            )
        return None

    def _refusal(self, headers: Headers) -> tuple[int, str] | None:
        host = headers.get("host", "")
        problem = self._host_refusal(host)
        if problem is not None:
            return 421, problem
        origin = headers.get("origin")
        if origin is not None and urlsplit(origin).netloc.lower() != host.lower():
            return 403, f"cross-origin requests are refused (Origin {_shown(origin)})"
        has_body = headers.get("content-length", "0") != "0" or "transfer-encoding" in headers
        media_type = headers.get("content-type", "").split(";")[0].strip().lower()
        if has_body and media_type != "application/json":
            return 415, "request bodies must be JSON, sent with Content-Type: application/json"
        return None

    async def __call__(self, scope, receive, send) -> None:
        refusal = self._refusal(Headers(scope=scope)) if scope["type"] == "http" else None
        if refusal is None:
            await self.app(scope, receive, send)
            return
        status, message = refusal
        body = self.refusal_body(status, message)
        await JSONResponse(body, status_code=status)(scope, receive, send)


def _shown(header: str) -> str:
    """A header value as a refusal quotes it: its repr, cut at `clip`'s length."""
    return clip(repr(header))


class StrictJsonRoute(APIRoute):
    """A route whose request body, when there is one, must be standard JSON (400 if not)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict_json(request: Request) -> Response:
            try:
                body = await request.body()  # kept by the request for the handler
            except ClientDisconnect:  # gone, or closed by the read timeout: nobody to answer
                return Response(status_code=400)
            if body:
                try:
                    from_json(body)
                except ValueError as error:
                    raise HTTPException(400, f"the body is not standard JSON: {error}") from None
            return await handler(request)

        return strict_json


def _is_json(value: object) -> bool:
    try:
        json.dumps(value, allow_nan=False, ensure_ascii=False).encode("utf-8")
    except (TypeError, ValueError):  # NaN, infinities; UnicodeEncodeError for lone surrogates
        return False
    return True


async def _invalid_request(_request: Request, error: RequestValidationError) -> JSONResponse:
    """422 naming every invalid field; a part of an error that is no JSON is left out."""
    errors = jsonable_encoder(error.errors())
    detail = [{key: value for key, value in e.items() if _is_json(value)} for e in errors]
    return JSONResponse({"detail": detail}, status_code=422)


def guarded_app(
    *,
    allowed_hosts: Collection[str] = (),
    refusal_body: RefusalBody = detail_body,
    refusal_schema: dict = DETAIL_SCHEMA,
    **fastapi: Any,
) -> FastAPI:
    """A FastAPI app (`fastapi` its arguments) with every guard of the module docstring,
    serving `Host`s that are loopback or in `allowed_hosts`; the middlewares' refusals are
    `refusal_body(status, message)`, documented on every operation with `refusal_schema`."""
    app = FastAPI(responses=refusals(refusal_schema, GUARD_REFUSALS), **fastapi)
    app.router.route_class = StrictJsonRoute
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_middleware(RequestGuard, allowed_hosts=allowed_hosts, refusal_body=refusal_body)
    # outermost: a body too large is refused first
    app.add_middleware(BodyLimit, refusal_body=refusal_body)
    return app


class GuardedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a read timeout and a cap on open connections."""

    def __init__(self, *args: Any, read_timeout_s: float, max_connections: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._read_timeout_s = read_timeout_s
        self._max_connections = max_connections
        self._read_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self._max_connections:
            transport.close()
            return
        self._start_read_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._start_read_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        super().connection_lost(exc)

    def _start_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        self._read_timer = self.loop.call_later(self._read_timeout_s, self._read_timed_out)

    def _read_timed_out(self) -> None:
        """Close unless a whole request arrived and its answer is being made."""
        cycle = self.cycle
        if cycle is None or cycle.response_complete or cycle.more_body:
            self.transport.close()


def server_config(app: FastAPI, *, host: str, port: int, server: ServerSettings) -> uvicorn.Config:
    """uvicorn's configuration for `app` on `host:port` with `server`'s connection limits."""
    protocol = functools.partial(
        GuardedH11Protocol,
        read_timeout_s=server.read_timeout.total_seconds(),
        max_connections=server.max_connections,
    )
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol,
        timeout_keep_alive=server.keep_alive.total_seconds(),
        log_level="warning",
        lifespan="on",
    )
