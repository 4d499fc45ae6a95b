"""Checks every request passes before any route sees it (pure ASGI).

``BodyLimit`` (the admin API, Agent-lightning's routes, OTLP ingest, the Osmosis callback — the data plane has its
own): a body over ``ROLLWAY_MAX_BODY_BYTES`` is a 413, one not all there within ``ROLLWAY_BODY_TIMEOUT`` a 408.
FastAPI reads a route's whole body into memory before it runs the route's dependencies, the admin-token check
among them, so without these bounds any client that can reach the port could make the server hold gigabytes, or
connections for ever, with no token at all.

``LoopbackOnly`` (every route): with no admin token the server listens on loopback only (``rollway serve``
refuses otherwise), and loopback is then all that guards it. A web page the operator opens can still reach it:
through DNS rebinding (the page's own host name, re-pointed at 127.0.0.1, so its scripts read the answers) or
by posting across sites (a form or ``fetch`` in ``no-cors`` mode: pause a model, cancel a rollout, spend the
backend's key). So without an admin token a request must name a loopback host (``Host``) and, when a browser
says where it comes from (``Origin``), come from a loopback page; ``ROLLWAY_PUBLIC_URL``'s host counts as one.
Programs (SDKs, curl, runners) send no ``Origin`` and address the server as they reach it: they pass.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import urlsplit

import orjson
from starlette.exceptions import HTTPException

from rollway.envelope import envelope
from rollway.settings import Settings

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def _refuse(send: Send, status: int, message: str, type_: str) -> None:
    body = orjson.dumps(envelope(message, type_))
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """A declared ``Content-Length`` over the limit is refused before a byte is read; a body sent in chunks is
    counted as it is read, and refused (``HTTPException``, answered by the app's handler) once over."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.limit = settings.max_body_bytes
        self.timeout = settings.body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, timeout = self.limit, self.timeout
        message = f"the request body is larger than {limit} bytes"
        declared = next((value for name, value in scope["headers"] if name == b"content-length"), b"")
        if declared.isdigit() and int(declared) > limit:
            await _refuse(send, 413, message, "invalid_request_error")
            return
        size, whole = 0, False
        deadline = time.monotonic() + timeout

        async def bounded() -> Message:
            nonlocal size, whole
            if whole:  # the body is all there: a later receive waits for the client to leave, as long as it takes
                return await receive()
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    event = await receive()
            except TimeoutError:  # a body sent a byte at a time, or never finished (408: the connection closes)
                raise HTTPException(
                    408, f"the request body did not arrive within {timeout:g} s", {"connection": "close"}
                ) from None
            if event["type"] == "http.request":
                size += len(event.get("body", b""))
                if size > limit:
                    raise HTTPException(413, message)
                whole = not event.get("more_body", False)
            return event

        await self.app(scope, bounded, send)


class LoopbackOnly:
    """Without an admin token: refuse (403) a request addressed to a host that is not loopback, or sent by a
    browser from a page that is not (see the module docstring). With one, every request passes."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.open = settings.admin_token is not None
        self.public = urlsplit(settings.public_url).hostname if settings.public_url else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.open or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        public = self.public
        for name, value in scope["headers"]:
            if name == b"host" and not _allowed(_host_of(value.decode("latin-1")), public):
                await _refuse(send, 403, _REFUSED_HOST, "permission_error")
                return
            if name == b"origin" and not _allowed(urlsplit(value.decode("latin-1")).hostname, public):
                await _refuse(send, 403, _REFUSED_ORIGIN, "permission_error")
                return
        await self.app(scope, receive, send)


_REFUSED_HOST = (
    "without an admin token this server answers requests addressed to a loopback host only (Host: 127.0.0.1, "
    "localhost, [::1] or ROLLWAY_PUBLIC_URL's host); set ROLLWAY_ADMIN_TOKEN to serve other names"
)
_REFUSED_ORIGIN = "without an admin token this server does not answer web pages from other hosts (Origin)"


def _host_of(header: str) -> str:
    """``Host``'s name without its port (``[::1]:8080`` → ``::1``)."""
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


@functools.lru_cache(maxsize=256)  # one Host per way a client reaches the server: parsed once, not per call
def _allowed(host: str | None, public: str | None) -> bool:
    if not host:
        return False
    host = host.lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost") or host == (public or "").lower():
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
