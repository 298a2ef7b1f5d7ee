"""The worker's answers as JSON, and every refusal of it as an OpenAI error object.

Bodies are written ASCII-escaped, so no text (a lone surrogate included) can
break the encoding; a 422 names each bad field without echoing the input.
"""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from blocktune.runtime.engine_loop import EngineStepFailed
from blocktune.runtime.requests import RequestError, RequestFailed
from blocktune.tuner.serving.openai_api import OpenAIError

__all__ = ["ENGINE_FAILURES", "add_error_handlers", "json_response", "refusal", "refusal_body"]

HTTP_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
# What can end an engine job: a refusal at admission, a failure of the request's own, a step's.
ENGINE_FAILURES = (RequestError, RequestFailed, EngineStepFailed)


def json_response(body: dict, status_code: int = 200, headers: dict | None = None) -> Response:
    """`body` as an ASCII-escaped JSON response."""
    return Response(
        json.dumps(body, allow_nan=False), status_code, headers, media_type="application/json"
    )


def refusal(error: Exception) -> OpenAIError:
    """The error object for an exception that ended an engine job (`ENGINE_FAILURES`): 400
    for a request the engine refused, 500 for one that failed alone (as vLLM answers its
    finish reason "error"), 503 for a failed step."""
    if isinstance(error, RequestError):
        return OpenAIError(400, str(error))
    status = 500 if isinstance(error, RequestFailed) else 503
    return OpenAIError(status, str(error), type="server_error")


def refusal_body(status: int, message: str) -> dict:
    """A refusal of the guard middlewares as an OpenAI error object."""
    return OpenAIError(status, message).body


def _validation_error(_: Request, error: RequestValidationError) -> Response:
    """422 naming each bad field; the input itself is never echoed (NaN or a lone surrogate
    cannot be written as JSON)."""
    problems = [
        (".".join(str(part) for part in e["loc"] if part != "body") or "body", e["msg"])
        for e in error.errors()
    ]
    message = "; ".join(f"{where}: {what}" for where, what in problems[:5])
    param = problems[0][0] if problems else None
    return json_response(OpenAIError(422, message or "invalid request", param=param).body, 422)


async def _openai_error(_: Request, error: OpenAIError) -> Response:
    return json_response(error.body, error.status)


async def _http_error(request: Request, error: StarletteHTTPException) -> Response:
    kind = "server_error" if error.status_code >= 500 else "invalid_request_error"
    body = OpenAIError(error.status_code, str(error.detail), type=kind).body
    headers = error.headers
    if error.status_code == 405:
        headers = {**(headers or {}), "Allow": _allowed_methods(request)}
    return json_response(body, error.status_code, headers)


def _allowed_methods(request: Request) -> str:
    """Every method some route serves at the request's path (Starlette's 405 names only
    the first route's, and /health has one route per method)."""
    routes = request.app.router.routes
    return ", ".join(
        method
        for method in HTTP_METHODS
        if any(r.matches({**request.scope, "method": method})[0] is Match.FULL for r in routes)
    )


def add_error_handlers(app: FastAPI) -> None:
    """Every refusal in OpenAI's error shape, whatever raised it."""
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
