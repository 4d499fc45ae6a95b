"""The error envelope (OpenAI's shape) and the one table that maps store errors to HTTP statuses."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollway.store import errors as store_errors

#: Store error kind → (HTTP status, OpenAI error type).
STATUS_FOR: dict[type[store_errors.StoreError], tuple[int, str]] = {
    store_errors.NotFoundError: (404, "not_found_error"),
    store_errors.ConflictError: (409, "conflict_error"),
    store_errors.StoreValidationError: (400, "invalid_request_error"),
    store_errors.UnavailableError: (503, "service_unavailable"),
}

TYPE_FOR_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_exceeded",
}


def envelope(message: str, type_: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(
    status: int, message: str, *, type_: str | None = None, param: str | None = None, code: str | None = None
) -> JSONResponse:
    kind = type_ or TYPE_FOR_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return JSONResponse(envelope(message, kind, param=param, code=code), status_code=status)


async def _store_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, store_errors.StoreError)
    for kind, (status, type_) in STATUS_FOR.items():
        if isinstance(exc, kind):
            return error_response(status, exc.message, type_=type_)
    return error_response(500, exc.message, type_="server_error")


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
    """Make every error leave the app in the envelope."""
    app.add_exception_handler(store_errors.StoreError, _store_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
