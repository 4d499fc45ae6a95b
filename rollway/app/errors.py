"""Every error of the FastAPI routes (the admin API, Agent-lightning's, the Osmosis callback, the probes) leaves the
app in OpenAI's envelope (``rollway.envelope``): store errors with the status of their kind, validation errors as
400s, Starlette's HTTP errors (404 for an unknown route, 405, 413) with their own status. The data plane answers its
own errors (``rollway.gateway.errors``)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollway.envelope import envelope, store_error_status, type_for
from rollway.store.errors import StoreError


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


def install(app: FastAPI) -> None:
    """Make every error of the app's routes leave it in the envelope."""
    app.add_exception_handler(StoreError, _store_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
