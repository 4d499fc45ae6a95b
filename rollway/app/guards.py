"""Checks every request passes before any route sees it (pure ASGI).

``BodyLimit`` (the admin API, Agent-lightning's routes, OTLP ingest, the Osmosis callback — the data plane has its
own): a body over ``ROLLWAY_MAX_BODY_BYTES`` is a 413, one not all there within ``ROLLWAY_BODY_TIMEOUT`` a 408.
FastAPI reads a route's whole body into memory before it runs the route's dependencies, the admin-token check
among them, so without these bounds any client that can reach the port could make the server hold gigabytes, or
connections for ever, with no token at all.

``HostOriginGuard`` (every route) keeps web pages the operator opens from using the server: a page on another
origin posting across sites (a form, or ``fetch`` in ``no-cors`` mode: calls on the backend's key recorded into
a rollout, a model paused), and a DNS-rebinding page (its own host name re-pointed at the server, so that its
scripts also read the answers). Programs (SDKs, curl, runners) send no ``Origin`` and pass; browsers send one
with every cross-origin request and every POST. So:

- ``Origin``, always checked: a request that carries one is served only when it is the server's own origin
  (the one its ``Host`` names: the dashboard's pages) or ``ROLLWAY_PUBLIC_URL``'s (a proxy in front that
  rewrites ``Host``). ``null`` (sandboxed and ``file:`` pages) is refused. Rollway answers no CORS preflight,
  so no page of another origin could use the API anyway. A browser's request from another site without an
  ``Origin`` (an ``<img>`` or ``<script>``; ``Sec-Fetch-Site`` says ``cross-site`` or ``same-site``) is refused
  too; a link followed (``Sec-Fetch-Mode: navigate``) is not.
- ``Host``, checked without an admin token and whenever ``ROLLWAY_GATEWAY_AUTH`` is ``none`` (the data plane
  then answers whoever reaches it): a request must name a loopback host (``127.0.0.1``, ``[::1]``,
  ``localhost``, ``*.localhost``), ``ROLLWAY_PUBLIC_URL``'s host, the machine's own name or one of
  ``ROLLWAY_ALLOWED_HOSTS``; with an admin token also any IP address, since a rebinding page names a host whose
  DNS its author controls, never an address. Without an admin token the server listens on loopback only, and
  other addresses are refused: a proxy in front would otherwise open the admin API to whoever names one.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import socket
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import SplitResult, urlsplit

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


class HostOriginGuard:
    """Refuse (403) a request sent by a web page of another origin, or, while the Host check is on, addressed to
    a host name that is not allowed (see the module docstring)."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        public = urlsplit(settings.public_url) if settings.public_url else None
        names = {*settings.allowed_hosts, socket.gethostname().lower()}
        if public is not None and public.hostname:
            names.add(public.hostname.rstrip("."))
        self.check_host = "*" not in names and (settings.admin_token is None or settings.gateway_auth == "none")
        # Parsed once per value, not per call: one Host and one Origin per way clients reach the server.
        self.host_allowed = functools.lru_cache(maxsize=256)(
            functools.partial(_host_allowed, frozenset(names), settings.admin_token is not None)
        )
        own = _origin_of(public) if public is not None else None
        self.origin_allowed = functools.lru_cache(maxsize=256)(functools.partial(_origin_allowed, own))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host = origin = site = mode = None
        for name, value in scope["headers"]:
            if name == b"host":
                host = value
            elif name == b"origin":
                origin = value
            elif name == b"sec-fetch-site":
                site = value
            elif name == b"sec-fetch-mode":
                mode = value
        if self.check_host and host is not None and not self.host_allowed(host):
            await _refuse(send, 403, _REFUSED_HOST, "permission_error")
            return
        if origin is not None and not self.origin_allowed(origin, host):
            await _refuse(send, 403, _REFUSED_ORIGIN, "permission_error")
            return
        if origin is None and site in (b"cross-site", b"same-site") and mode != b"navigate":
            await _refuse(send, 403, _REFUSED_ORIGIN, "permission_error")
            return
        await self.app(scope, receive, send)


_REFUSED_HOST = (
    "this server answers requests addressed to its allowed host names only (Host): loopback, ROLLWAY_PUBLIC_URL's "
    "host, the machine's name and ROLLWAY_ALLOWED_HOSTS (and IP addresses when ROLLWAY_ADMIN_TOKEN is set): list "
    "the name clients use in ROLLWAY_ALLOWED_HOSTS (docs/security.md)"
)
_REFUSED_ORIGIN = (
    "this server does not answer web pages of other origins (Origin): only its own, and ROLLWAY_PUBLIC_URL's"
)


def _host_of(header: str) -> str:
    """``Host``'s name without its port (``[::1]:8080`` → ``::1``), in lower case, without a final dot."""
    if header.startswith("["):
        header = header[1:].partition("]")[0]
    elif header.count(":") == 1:
        header = header.rpartition(":")[0]
    return header.lower().rstrip(".")


def _host_allowed(names: frozenset[str], any_address: bool, header: bytes) -> bool:
    host = _host_of(header.decode("latin-1"))
    if not host:
        return False
    if host == "localhost" or host.endswith(".localhost") or host in names:
        return True
    if any(name.startswith(".") and host.endswith(name) for name in names):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return any_address or address.is_loopback


def _origin_of(url: SplitResult) -> bytes:
    """A URL's origin as a browser's ``Origin`` says it: lower case, without the scheme's default port."""
    host = url.hostname or ""
    host = f"[{host}]" if ":" in host else host
    port = "" if url.port in (None, {"http": 80, "https": 443}.get(url.scheme)) else f":{url.port}"
    return f"{url.scheme}://{host}{port}".lower().encode()


def _origin_allowed(own: bytes | None, origin: bytes, host: bytes | None) -> bool:
    """The request's own origin (``Origin``'s host and port are ``Host``'s; browsers leave a scheme's default port
    out of both), or ``ROLLWAY_PUBLIC_URL``'s. The scheme is not compared: behind a proxy that ends TLS the
    request's own is not the page's, and no other server can hold the same host and port."""
    origin = origin.lower()
    if origin == own:
        return True
    scheme, sep, netloc = origin.partition(b"://")
    return bool(sep) and scheme in (b"http", b"https") and host is not None and netloc == host.lower()
