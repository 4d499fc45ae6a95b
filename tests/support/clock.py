"""A clock the tests move by hand, so timeouts are tested without sleeping."""

from __future__ import annotations

import asyncio


class FakeClock:
    """A clock the tests move by hand, so timeouts are tested without sleeping. Handed in as a timer too, its
    ``sleep`` records the wait asked for and moves the clock past it at once."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start
        self.slept: list[float] = []  # every wait asked of ``sleep``, in order

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.advance(seconds)
        await asyncio.sleep(0)  # a real await: other tasks run, as they would during the wait
