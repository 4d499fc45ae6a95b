"""What one call is between the ASGI layer and ``gateway.proxy``: the reply it sends through, the error that
ends it (OpenAI's envelope, or the backend's own body) and the call prepared to run (record and alias lease)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from rollway.gateway.capture import CallRecord
from rollway.gateway.registry import Lease


class Reply(Protocol):
    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None: ...

    async def body(self, data: bytes, more: bool) -> None: ...

    async def whole(self, status: int, headers: list[tuple[bytes, bytes]], data: bytes) -> None: ...


def not_recorded() -> CallError:
    """A completion the backend gave but the store could not record: an error, not a completion."""
    return envelope(
        503,
        "the completion could not be recorded (the store is unavailable); it was not handed over: try again",
        "service_unavailable",
        "not_recorded",
    )


def withheld(record: CallRecord) -> bool:
    """Whether ``record``, whose span the store could not write, is a completion that is then not handed over
    (``not_recorded``: a 503, or a stream that ends in that error event instead of its end). If so the record
    says so, for the metrics and the exported copy of its span: error type ``not_recorded``, status 503 unless
    its 200 already went out with the stream."""
    if record.error is not None or record.cancelled or (record.status_code or 0) >= 400:
        return False
    record.error_type = "not_recorded"
    if record.accumulator is None:
        record.status_code = 503
    return True


class ClientStalled(Exception):
    """The client took no part of the answer for ``ROLLWAY_WRITE_TIMEOUT`` seconds (or until the rollout's
    deadline): a reader that stopped reading without closing, a suspended agent. The call ends (its backend
    request closed, its slot and lease given back, its span written) and so does the connection."""


class CallError(Exception):
    """The call ends with this status and body (an envelope, or the backend's own error body)."""

    def __init__(self, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        super().__init__(body.decode(errors="replace"))
        self.status = status
        self.body = body
        self.headers = headers or []
        self.counted = False  # True once the call's span (and metrics) are recorded


def envelope(status: int, message: str, type_: str, code: str | None = None, param: str | None = None) -> CallError:
    body = orjson.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}})
    return CallError(status, body)


@dataclass
class Prepared:
    record: CallRecord
    lease: Lease | None  # None while the call still has to wait for its paused alias (``Gateway.run``)
    path: str
    in_flight: Any = None  # the in-flight gauge child of the alias, once it holds its lease

    def release(self) -> None:
        """The call is over (answered, failed or cancelled): give back the alias lease."""
        if self.lease is not None:
            self.lease.release()
            self.in_flight.dec()


class Running:
    """How many calls the data plane is running; at shutdown the lifespan waits for none (``ended``): the calls
    uvicorn cancelled are writing their spans, which the store must still be open for."""

    def __init__(self) -> None:
        self.count = 0
        self._none = asyncio.Event()
        self._none.set()

    def started(self) -> None:
        self.count += 1
        self._none.clear()

    def done(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._none.set()

    async def ended(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for no call to be running; whether none is."""
        try:
            async with asyncio.timeout(timeout):
                await self._none.wait()
        except TimeoutError:
            return False
        return True
