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
  once and closed, before anything of it is parsed; the connections held are untouched. ``PROBE_CONNECTIONS``
  more are kept for the probes: a connection past the cap while fewer than that are open past it has its first
  request's head read, and a ``GET`` of ``/healthz``, ``/readyz`` or ``/metrics`` reaches the application, with
  ``SATURATED`` in its scope's state (``/readyz`` answers 503 to it); any other request gets the 503. So an
  orchestrator's liveness probe does not restart a process that is only full, its readiness probe takes it out
  of rotation, and the metrics can be scraped while it refuses connections. ``fit_open_files`` raises the
  process's soft open-file limit to fit the cap and lowers the cap to what the limit allows, so that the cap, not
  the descriptor table, is what refuses a connection: a process out of descriptors cannot accept one, not even to
  answer ``/healthz``.

Refusals are OpenAI error envelopes with ``Connection: close``, each counted by reason (``cap``,
``header_too_large``, ``header_timeout``) through the ``CONNECTIONS_REFUSED`` callable the application's lifespan
puts in its state (``rollway_connections_refused_total`` on ``/metrics``). A refusal on a connection whose earlier
answers are still being written waits for them to be written whole. After the refusal, the server shuts its side
for writing and drops whatever the client still sends until the client closes or ``LINGER`` seconds pass: closing
a socket with unread input makes the kernel reset the connection, and a reset can destroy the answer before the
client has read it.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import resource
from dataclasses import dataclass, replace
from typing import ClassVar

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from rollway.envelope import envelope
from rollway.settings import Settings

log = logging.getLogger("rollway.connections")
#: Seconds a refused connection drops the client's input before it is closed.
LINGER = 2.0
#: Descriptors each process keeps out of the connection cap's reach: the store, logs, listening sockets, files, and
#: the probes' connections (``PROBE_CONNECTIONS``).
RESERVE = 256
#: Connections past the cap that may still ask for one of ``PROBE_PATHS``.
PROBE_CONNECTIONS = 8
PROBE_PATHS = frozenset({b"/healthz", b"/readyz", b"/metrics"})
#: Key of a probe request's scope state when its connection is past the cap, the cap its value (``/readyz``: 503).
SATURATED = "rollway.connections_saturated"
#: Key of the application's lifespan state: a callable counting a refused connection by its reason.
CONNECTIONS_REFUSED = "rollway.connections_refused"
#: Seconds between two log lines about connections refused over the cap (a storm is a few lines, not thousands).
SHED_LOG_INTERVAL = 10.0
_OVER_CAP = "the server holds as many connections as it is allowed to: try again shortly"


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
    ``BoundedHttpToolsProtocol`` of its own (its limits, its count of refused connections, its probes' reserve)."""
    if limits.off:
        return HttpToolsProtocol
    attributes = {"limits": limits, "shed": _Shed(), "reserve": _Reserve()}
    return type("BoundedHttpToolsProtocol", (BoundedHttpToolsProtocol,), attributes)


class _Reserve:
    """The connections open past the cap, on the probes' reserve."""

    def __init__(self) -> None:
        self.open = 0


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


def _too_large(limit: int) -> str:
    return f"the request's head (request line and headers) is over {limit} bytes"


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds of ``limits`` (the module's description)."""

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()
    shed: ClassVar[_Shed] = _Shed()
    reserve: ClassVar[_Reserve] = _Reserve()

    # Per connection; class defaults, so that a connection costs no more set-up than uvicorn's own.
    _in_head = False  # a request has begun and its head is not complete
    _head_bytes = 0  # bytes of the head so far
    _read_size = 0  # bytes of the read being fed
    _read_body = 0  # bytes of a body parsed from it
    _head_timer: asyncio.TimerHandle | None = None
    _linger: asyncio.TimerHandle | None = None
    _refused = False  # the connection ends with a refusal: nothing more is parsed, input is dropped
    _probe = False  # opened past the cap, on the probes' reserve: one request, a probe's or refused

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        limits = self.limits
        if limits.max_connections and len(self.connections) - self.reserve.open > limits.max_connections:
            if self.reserve.open >= PROBE_CONNECTIONS:
                self.connections.discard(self)  # the cap counts the connections held, not the ones being refused
                self._refuse_over_cap()
                return
            self.reserve.open += 1
            self._probe = True
        if limits.idle_timeout:
            self.timeout_keep_alive_task = self.loop.call_later(limits.idle_timeout, self.timeout_keep_alive_handler)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._probe:
            self._probe = False
            self.reserve.open -= 1
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
            self._refuse_head_too_large()
        elif limits.header_timeout and self._head_timer is None:
            self._head_timer = self.loop.call_later(limits.header_timeout, self._head_expired)

    # The parser's callbacks: once the connection is refused, what is left of the read being fed makes no request
    # (its answer is the refusal). ``on_url`` and ``on_header`` are left as they are, costing nothing per header:
    # what they add to the refused request's head is at most the rest of that read, and is never used.

    def on_message_begin(self) -> None:
        if self._refused:
            return
        super().on_message_begin()
        self._in_head = True
        self._head_bytes = 0

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        self._in_head = False
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        limit = self.limits.max_header_bytes
        if limit and self._head_bytes + self._read_size > limit and self._head_size() > limit:
            self._refuse_head_too_large()
            return
        if self._probe:
            if not self._is_probe():
                self._refuse_over_cap()
                return
            self.scope["state"][SATURATED] = self.limits.max_connections
        super().on_headers_complete()
        if self._probe and self.cycle is not None:
            self.cycle.keep_alive = False  # closed once answered: the reserve's places are soon free again

    def _head_size(self) -> int:
        """The parsed head's size: its request line and its headers, each with its separators."""
        return len(self.url) + 16 + sum(len(name) + len(value) + 4 for name, value in self.headers)

    def _is_probe(self) -> bool:
        return self.parser.get_method() in (b"GET", b"HEAD") and self.url.partition(b"?")[0] in PROBE_PATHS

    def on_body(self, body: bytes) -> None:
        if self._refused:
            return
        self._read_body += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._refused:
            super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        if not self._refused:  # bytes that do not parse after a refusal: the refusal stays the connection's answer
            super().send_400_response(msg)

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
            "header_timeout",
        )

    def _answering(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _refuse_head_too_large(self) -> None:
        limit = self.limits.max_header_bytes
        self._refuse(
            431, _too_large(limit), "invalid_request_error", "request_header_fields_too_large", "header_too_large"
        )

    def _refuse_over_cap(self) -> None:
        self.shed.add(self.limits.max_connections, self.loop)
        self._refuse(503, _OVER_CAP, "service_unavailable", "too_many_connections", "cap", b"retry-after: 1\r\n")

    def _refuse(self, status: int, message: str, type_: str, code: str, reason: str, extra: bytes = b"") -> None:
        """Count the refusal by ``reason``, answer ``status`` once every answer before it on the connection is
        written, and end the connection (``_end_with``)."""
        self._refused, self._in_head = True, False
        self._unset_keepalive_if_required()
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        count = self.app_state.get(CONNECTIONS_REFUSED)
        if count is not None:
            count(reason)
        answer = _answer(status, message, type_, code, extra, self.server_state.default_headers)
        if self._answering():  # (the request answered last: any pipelined ones are answered before it)
            self.cycle.on_response = functools.partial(self._answered, answer)
            return
        self._end_with(answer)

    def _answered(self, refusal: bytes) -> None:
        """The answers before ``refusal`` are written: it is, and the connection ends."""
        self.server_state.total_requests += 1  # (as uvicorn's ``on_response_complete`` counts them)
        if not self.transport.is_closing():  # (that answer closed it)
            self._end_with(refusal)

    def _end_with(self, answer: bytes) -> None:
        """Write ``answer``, shut the connection for writing, drop the client's input, and close it once the client
        has closed its side or after ``LINGER`` seconds."""
        transport = self.transport
        transport.write(answer)
        self.flow.resume_reading()  # (paused behind a pipelined request, say): what arrives is read and dropped
        if transport.can_write_eof():
            transport.write_eof()
            self._linger = self.loop.call_later(LINGER, transport.close)
        else:
            transport.close()
