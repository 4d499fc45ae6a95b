"""Every error of the FastAPI routes (the admin API, Agent-lightning's, the Osmosis callback, the probes) leaves the
app in OpenAI's envelope (``rollway.envelope``): store errors with the status of their kind, validation errors as
400s, Starlette's HTTP errors (404 for an unknown route, 405, 413) with their own status. The data plane answers its
own errors (``rollway.gateway.errors``).

Whatever else a route lets through is answered by ``LastResort``: a database failure the store did not name as
one is a 503, anything else a 500, both in the envelope, logged once per kind per interval. Without it Starlette
would answer ``500 Internal Server Error`` in plain text and uvicorn would close the client's connection after it:
an agent's next call on its pooled connection would fail too.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from rollway.envelope import envelope, store_error_status, type_for
from rollway.store.db.faults import FailureLog, unavailable
from rollway.store.errors import StoreError

log = logging.getLogger("rollway.app")


def error_response(
    status: int, message: str, *, type_: str | None = None, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(envelope(message, type_ or type_for(status), param=param, code=code), status_code=status)


async def _store_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StoreError)
    status, type_ = store_error_status(exc)
    return error_response(status, exc.message, type_=type_)


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
    message = f"{'.'.join(loc) + ': ' if loc else ''}{first.get('msg', 'invalid request')}"
    return error_response(400, message, param=".".join(loc) or None)


async def _http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    response = error_response(exc.status_code, str(exc.detail))
    if exc.headers:
        response.headers.update(exc.headers)
    return response


class LastResort:
    """Pure ASGI middleware around the routes: an exception that reaches it before its answer started is answered
    in the envelope (503 for the database's failures, 500 otherwise) and goes no further; one raised once the
    answer started goes on (that answer cannot be finished: its connection is closed)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.failures = FailureLog()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def sending(message: MutableMapping[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as exc:
            if started:
                raise
            failure = exc if isinstance(exc, StoreError) else unavailable(exc)
            if failure is not None:
                status, type_ = store_error_status(failure)
                message = failure.message
                self.failures.log(log, f"route:{type_}", "%s %s: %s", *_where(scope), message)
            else:
                status, type_, message = 500, "server_error", f"internal error: {type(exc).__name__}"
                self.failures.log(log, f"route:{type(exc).__name__}", "%s %s failed", *_where(scope), exc_info=exc)
            body = orjson.dumps(envelope(message, type_))
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})


def _where(scope: Scope) -> tuple[str, str]:
    return scope["method"], scope["path"]


def install(app: FastAPI) -> None:
    """Make every error of the app's routes leave it in the envelope."""
    app.add_exception_handler(StoreError, _store_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_middleware(LastResort)  # (added first: the innermost of the app's middleware, around the routes)
