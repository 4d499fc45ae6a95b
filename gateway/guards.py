"""Checks every request passes before any route sees it (pure ASGI).

``BodyLimit`` (the admin API, Agent-lightning's routes, OTLP ingest, the Osmosis callback — the data plane has its
own): a body over ``ROLLWAY_MAX_BODY_BYTES`` is a 413. FastAPI reads a route's whole body into memory before it
runs the route's dependencies, the admin-token check among them, so without a bound any client that can reach
the port could make the server hold gigabytes with no token at all.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson
from starlette.exceptions import HTTPException

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
DEFAULT_LIMIT = 32 * 1024 * 1024  # the setting's default, should a request come before the lifespan set it up


async def _refuse(send: Send, status: int, message: str, type_: str) -> None:
    body = orjson.dumps({"error": {"message": message, "type": type_, "param": None, "code": None}})
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _settings(scope: Scope) -> Any:
    return getattr(getattr(scope["app"].state, "rollway", None), "settings", None)


class BodyLimit:
    """A declared ``Content-Length`` over the limit is refused before a byte is read; a body sent in chunks is
    counted as it is read, and refused (``HTTPException``, answered by the app's handler) once over."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = getattr(_settings(scope), "max_body_bytes", DEFAULT_LIMIT)
        message = f"the request body is larger than {limit} bytes"
        declared = next((value for name, value in scope["headers"] if name == b"content-length"), b"")
        if declared.isdigit() and int(declared) > limit:
            await _refuse(send, 413, message, "invalid_request_error")
            return
        size = 0

        async def bounded() -> Message:
            nonlocal size
            event = await receive()
            if event["type"] == "http.request":
                size += len(event.get("body", b""))
                if size > limit:
                    raise HTTPException(413, message)
            return event

        await self.app(scope, bounded, send)
