"""What one call is between the ASGI layer and ``gateway.proxy``: the reply it sends through, the call prepared to
run (record and alias lease) and the count of calls running. How a call ends is ``gateway.outcome``'s."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol

from rollway.gateway.record import CallRecord
from rollway.gateway.registry import Lease


class Reply(Protocol):
    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None: ...

    async def body(self, data: bytes, more: bool) -> None: ...

    async def whole(self, status: int, headers: list[tuple[bytes, bytes]], data: bytes) -> None: ...


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
