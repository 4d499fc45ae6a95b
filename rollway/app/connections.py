"""Bounded client connections: what a connection may cost the server before its request reaches the application.

uvicorn's httptools protocol, the one ``rollway serve`` runs, bounds nothing before a request's head (request line
and headers) is complete: a head grows in memory as long as the client sends it, and a connection that sends
nothing, or a header line now and then, is held for ever. ``BoundedHttpToolsProtocol`` adds four bounds, each a
setting that 0 turns off:

- ``max_header_bytes``: a head longer than this is answered 431. The bytes a connection has sent since its request
  began (less the previous request's body) are counted after each read, so a head never holds more than the
  limit plus one read (uvloop reads at most 256,000 bytes at a time); a head that ends within a read that could
  have taken it past the limit is measured whole once parsed, and if it is over, the request is answered 431
  instead of reaching the application.
- ``header_timeout``: a head still incomplete this many seconds after its first read is answered 408. One timer per
  request, armed only when a read ends inside the head: a head that arrives in one read (any agent's) costs no
  timer at all.
- ``idle_timeout``: a connection that sends nothing for this many seconds after it opens is closed. This is
  uvicorn's keep-alive timer, armed once at the connection's start; the first byte cancels it, as it does between
  requests (``keepalive_timeout``).
- ``max_connections``: a connection that would be one more than this is answered 503 (with ``Retry-After``) at
  once and closed, before anything of it is parsed; the connections already held are untouched.
  ``fit_open_files`` raises the process's soft open-file limit to fit the cap and lowers the cap to what the limit
  allows, so that the cap, not the descriptor table, is what refuses a connection: a process out of descriptors
  cannot accept one, not even to answer ``/healthz``.

Refusals are OpenAI error envelopes with ``Connection: close``. After one, the server shuts its side for writing
and drops whatever the client still sends until the client closes or ``LINGER`` seconds pass: closing a socket
with unread input makes the kernel reset the connection, and a reset can destroy the answer before the client
has read it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from dataclasses import dataclass, replace
from typing import ClassVar

from uvicorn._types import ASGI3Application, ASGIReceiveCallable, ASGISendCallable, Scope
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from rollway.envelope import envelope
from rollway.settings import Settings

log = logging.getLogger("rollway.connections")
#: Seconds a refused connection drops the client's input before it is closed.
LINGER = 2.0
#: Descriptors each process keeps out of the connection cap's reach: the store, logs, listening sockets, files.
RESERVE = 256
#: Seconds between two log lines about connections refused over the cap (a storm is a few lines, not thousands).
SHED_LOG_INTERVAL = 10.0


@dataclass(frozen=True)
class ConnectionLimits:
    """The bounds of ``BoundedHttpToolsProtocol`` (0: none)."""

    max_connections: int = 0
    max_header_bytes: int = 0
    header_timeout: float = 0.0
    idle_timeout: float = 0.0

    @classmethod
    def from_settings(cls, settings: Settings) -> ConnectionLimits:
        return cls(settings.max_connections, settings.max_header_bytes, settings.header_timeout, settings.idle_timeout)

    @property
    def off(self) -> bool:
        return not (self.max_connections or self.max_header_bytes or self.header_timeout or self.idle_timeout)


def fit_open_files(limits: ConnectionLimits, chosen: bool = True) -> ConnectionLimits:
    """Raise this process's soft ``RLIMIT_NOFILE`` (up to its hard limit) to hold two descriptors per connection of
    the cap (the client's and the backend call it may make) and ``RESERVE`` more; the limits with the cap lowered
    to what the open-file limit then allows. Lowering a cap the operator ``chosen`` is a warning; lowering the
    default (sized for machines with a large hard limit) is said at info level."""
    if not limits.max_connections:
        return limits
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 2 * limits.max_connections + RESERVE
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, raised, exc)
    if soft == resource.RLIM_INFINITY:
        return limits
    fits = max(1, (soft - RESERVE) // 2)
    if fits >= limits.max_connections:
        return limits
    log.log(
        logging.WARNING if chosen else logging.INFO,
        "ROLLWAY_MAX_CONNECTIONS %d lowered to %d: the open-file limit is %d (raise it with ulimit -n, or "
        "LimitNOFILE= under systemd)",
        limits.max_connections,
        fits,
        soft,
    )
    return replace(limits, max_connections=fits)


def protocol_class(limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """The HTTP protocol a server with these limits runs: uvicorn's own when every limit is off, else a subclass of
    ``BoundedHttpToolsProtocol`` of its own (its limits and its count of refused connections)."""
    if limits.off:
        return HttpToolsProtocol
    return type("BoundedHttpToolsProtocol", (BoundedHttpToolsProtocol,), {"limits": limits, "shed": _Shed()})


class _Shed:
    """Connections refused over the cap: the first of a storm logged at once, the rest counted and logged in one
    line per ``SHED_LOG_INTERVAL`` while they go on."""

    def __init__(self) -> None:
        self.count = 0  # refused since the last line
        self.flush: asyncio.TimerHandle | None = None

    def add(self, cap: int, loop: asyncio.AbstractEventLoop) -> None:
        if self.flush is not None:
            self.count += 1
            return
        log.warning("refusing new connections with 503: %d held (ROLLWAY_MAX_CONNECTIONS)", cap)
        self.flush = loop.call_later(SHED_LOG_INTERVAL, self._flush, cap, loop)

    def _flush(self, cap: int, loop: asyncio.AbstractEventLoop) -> None:
        self.flush = None
        if self.count:
            count, self.count = self.count, 0
            log.warning(
                "%d more connections refused with 503 in the last %g s (%d held)", count, SHED_LOG_INTERVAL, cap
            )
            self.flush = loop.call_later(SHED_LOG_INTERVAL, self._flush, cap, loop)


def _answer(
    status: int, message: str, type_: str, code: str, extra: bytes, default: list[tuple[bytes, bytes]]
) -> bytes:
    body = json.dumps(envelope(message, type_, code=code)).encode()
    head = [STATUS_LINE[status]]
    for name, value in default:
        head += [name, b": ", value, b"\r\n"]
    head += [
        b"content-type: application/json\r\ncontent-length: ",
        str(len(body)).encode(),
        b"\r\nconnection: close\r\n",
        extra,
        b"\r\n",
        body,
    ]
    return b"".join(head)


def _head_too_large(limit: int) -> ASGI3Application:
    """An ASGI application that answers 431 and closes the connection."""
    error = envelope(_too_large(limit), "invalid_request_error", code="request_header_fields_too_large")
    body = json.dumps(error).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]

    async def app(scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        await send({"type": "http.response.start", "status": 431, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


def _too_large(limit: int) -> str:
    return f"the request's head (request line and headers) is over {limit} bytes"


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds of ``limits`` (the module's description)."""

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()
    shed: ClassVar[_Shed] = _Shed()

    # Per connection; class defaults, so that a connection costs no more set-up than uvicorn's own.
    _in_head = False  # a request has begun and its head is not complete
    _head_bytes = 0  # bytes of the head so far
    _read_size = 0  # bytes of the read being fed
    _read_body = 0  # bytes of a body parsed from it
    _head_timer: asyncio.TimerHandle | None = None
    _linger: asyncio.TimerHandle | None = None
    _refused = False  # an answer that ends the connection is written: input is dropped

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        limits = self.limits
        if limits.max_connections and len(self.connections) > limits.max_connections:
            self.connections.discard(self)  # the cap counts the connections held, not the ones being refused
            self.shed.add(limits.max_connections, self.loop)
            self._refuse(
                503,
                "the server holds as many connections as it is allowed to: try again shortly",
                "service_unavailable",
                "too_many_connections",
                b"retry-after: 1\r\n",
            )
            return
        if limits.idle_timeout:
            self.timeout_keep_alive_task = self.loop.call_later(limits.idle_timeout, self.timeout_keep_alive_handler)

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head_timer, self._linger):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._linger = None
        self._unset_keepalive_if_required()  # (uvicorn leaves it running when the connection was reset)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        self._read_size, self._read_body = len(data), 0
        super().data_received(data)
        if not self._in_head or self.transport.is_closing():
            return
        # A head begun in this read starts from 0 (``on_message_begin``); what the read held of the previous
        # request's body is not the head's.
        self._head_bytes += len(data) - self._read_body
        limits = self.limits
        if limits.max_header_bytes and self._head_bytes > limits.max_header_bytes:
            self._refuse(
                431,
                _too_large(limits.max_header_bytes),
                "invalid_request_error",
                "request_header_fields_too_large",
            )
        elif limits.header_timeout and self._head_timer is None:
            self._head_timer = self.loop.call_later(limits.header_timeout, self._head_expired)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._head_bytes = 0

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        limit = self.limits.max_header_bytes
        if limit and self._head_bytes + self._read_size > limit and self._head_size() > limit:
            # Answered through uvicorn's own request cycle, so that the parser goes on through the request's body
            # (and any request after it) as it does for every request; the application is not called.
            app, self.app = self.app, _head_too_large(limit)
            try:
                super().on_headers_complete()
            finally:
                self.app = app
            return
        super().on_headers_complete()

    def _head_size(self) -> int:
        """The parsed head's size: its request line and its headers, each with its separators."""
        return len(self.url) + 16 + sum(len(name) + len(value) + 4 for name, value in self.headers)

    def on_body(self, body: bytes) -> None:
        self._read_body += len(body)
        super().on_body(body)

    def _head_expired(self) -> None:
        self._head_timer = None
        if not self._in_head or self.transport.is_closing():
            return
        if self._answering():  # a pipelined head waits while the request before it is answered
            self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_expired)
            return
        self._refuse(
            408,
            f"the request's head (request line and headers) did not arrive within {self.limits.header_timeout:g} s",
            "invalid_request_error",
            "request_timeout",
        )

    def _answering(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _refuse(self, status: int, message: str, type_: str, code: str, extra: bytes = b"") -> None:
        """Answer ``status`` and end the connection: shut it for writing, drop the client's input, close it once
        the client has closed its side or after ``LINGER`` seconds."""
        self._refused, self._in_head = True, False
        self._unset_keepalive_if_required()
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        transport = self.transport
        if self._answering():  # an answer is being written on this connection: no second one can be
            transport.close()
            return
        transport.write(_answer(status, message, type_, code, extra, self.server_state.default_headers))
        if transport.can_write_eof():
            transport.write_eof()
            self._linger = self.loop.call_later(LINGER, transport.close)
        else:
            transport.close()
