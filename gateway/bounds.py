"""Coarse time bounds for the data plane's waits on its client: ``asyncio.timeout`` without a timer per wait.

Every call waits on its client at least twice (its body, then each send of its answer), and a client that stops
reading or sending must not hold a call for ever (``ROLLWAY_BODY_TIMEOUT``, ``ROLLWAY_WRITE_TIMEOUT``, the
rollout's deadline). ``asyncio.timeout`` arms and cancels a timer for each wait, ~6 µs, on every call and every
chunk of a stream. Here a wait only notes when it began (``Bound.within``: two attribute writes and a set
insert); one ``Sweeper`` per process looks at the waits in progress a few times a second and cancels the task
of any past its bound, which then sees ``TimeoutError`` as with ``asyncio.timeout``. A bound is thus kept to
within ``Sweeper.every`` seconds — fine for limits of a second or more.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from types import TracebackType

#: How often the sweeper looks (seconds): the precision of every bound.
SWEEP_EVERY = 0.25


class Bound:
    """The bound of one task's waits, used as ``with bound.within(seconds, deadline):`` around one wait at a time."""

    __slots__ = ("_cancelling", "_sweeper", "deadline", "fired", "limit", "since", "task")

    def __init__(self, sweeper: Sweeper, task: asyncio.Task[object] | None = None) -> None:
        self._sweeper = sweeper
        self.task = task if task is not None else asyncio.current_task()
        self.since = 0.0
        self.limit = 0.0
        self.deadline: float | None = None  # wall clock
        self.fired = False
        self._cancelling = 0

    def within(self, seconds: float, deadline: float | None = None) -> Bound:
        """The next wait may take ``seconds``, and not go past ``deadline`` (``time.time()``) either."""
        self.limit = seconds
        self.deadline = deadline
        return self

    def due(self, now: float, wall: float) -> bool:
        return now - self.since >= self.limit or (self.deadline is not None and wall >= self.deadline)

    def fire(self) -> None:
        if self.task is not None and not self.task.done():
            self.fired = True
            self.task.cancel()

    def __enter__(self) -> Bound:
        self.since = time.monotonic()
        self.fired = False
        if self.task is not None:
            self._cancelling = self.task.cancelling()
            self._sweeper.waits.add(self)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._sweeper.waits.discard(self)
        if not self.fired:
            return
        self.fired = False
        assert self.task is not None
        # As asyncio.timeout: our cancellation (and no other one) becomes a TimeoutError.
        if self.task.uncancel() <= self._cancelling and kind is asyncio.CancelledError:
            raise TimeoutError from exc


class Sweeper:
    """Cancels the waits past their bound (see the module docstring); started and stopped with the gateway."""

    def __init__(self, every: float = SWEEP_EVERY) -> None:
        self.every = every
        self.waits: set[Bound] = set()
        self._task: asyncio.Task[None] | None = None

    def bound(self) -> Bound:
        """A bound for the current task's waits."""
        return Bound(self)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="rollway-wait-bounds")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def sweep(self) -> None:
        now, wall = time.monotonic(), time.time()
        for bound in [b for b in self.waits if b.due(now, wall)]:
            self.waits.discard(bound)
            bound.fire()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.every)
            self.sweep()
