"""What blocktune's HTTP services share: bearer-token auth, safe binding, body limits.

Both the sidecar and the worker are FastAPI apps served by uvicorn. Mutating
endpoints require `Authorization: Bearer <token>` when a token is configured
(compared in constant time); without a token a service refuses to bind
anything but a loopback address. Request bodies over `max_body_bytes` are
refused with 413 before they are read whole.
"""

from __future__ import annotations

import hmac
import ipaddress

from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse

__all__ = [
    "BodyLimit",
    "BearerAuth",
    "InsecureBind",
    "check_bind",
]

MAX_BODY_BYTES = 1 << 20


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

    def __init__(self, app, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

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
            error = self._too_large()
            response = JSONResponse({"detail": error.detail}, status_code=413)
            await response(scope, receive, send)
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
