"""The OpenAI error envelope and the HTTP statuses of store errors, shared by every HTTP edge of the server.

Every error Rollway answers has OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, built by
``envelope``: the data plane's (``rollway.gateway.errors``), the admin API's and the protocols' (their exception
handlers, ``rollway.app.errors``), and the mock backend's. The store's errors carry no HTTP status;
``STORE_ERROR_STATUS`` is the one table that gives them one.
"""

from __future__ import annotations

from typing import Any

from rollway.store.errors import ConflictError, NotFoundError, StoreError, StoreValidationError, UnavailableError

#: Store error kind → (HTTP status, OpenAI error type); any other store error is a 500 ``server_error``.
STORE_ERROR_STATUS: dict[type[StoreError], tuple[int, str]] = {
    NotFoundError: (404, "not_found_error"),
    ConflictError: (409, "conflict_error"),
    StoreValidationError: (400, "invalid_request_error"),
    UnavailableError: (503, "service_unavailable"),
}

#: The error type of an HTTP status, when the answer names none of its own.
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


def envelope(message: str, type_: str, *, param: str | None = None, code: str | int | None = None) -> dict[str, Any]:
    """An error in OpenAI's shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def type_for(status: int) -> str:
    return TYPE_FOR_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")


def store_error_status(exc: StoreError) -> tuple[int, str]:
    """The HTTP status and error type a store error is answered with."""
    for kind, answer in STORE_ERROR_STATUS.items():
        if isinstance(exc, kind):
            return answer
    return 500, "server_error"
