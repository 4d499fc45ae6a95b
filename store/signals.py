"""In-process wake-ups, so waiters (claim long-polls, wait-for-rollouts) sleep instead of polling.

A waiter takes the current ``Signal`` generation *before* it checks its condition, then waits on it; a
``notify()`` between the check and the wait still wakes it. Changes made by other processes sharing the
database are seen at the next bounded re-check.
"""

from __future__ import annotations

import asyncio
import contextlib


class Signal:
    def __init__(self) -> None:
        self._event = asyncio.Event()

    def generation(self) -> asyncio.Event:
        return self._event

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    @staticmethod
    async def wait(generation: asyncio.Event, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(generation.wait(), timeout)
