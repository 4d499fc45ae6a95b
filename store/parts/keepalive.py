"""A call in flight is a heartbeat. Every span is one, but an LLM call's span is written when the call ends (it
holds the answer), so a call longer than its rollout's ``unresponsive_seconds`` (a long generation, a call
waiting out a paused alias) would leave its attempt silent: the watchdog would mark it ``unresponsive`` and
requeue a rollout that is still running, for another worker to run again.

``CallsInFlight`` is this process's record of the calls ``Store.begin_call`` admitted whose span
``Store.record_call`` has not written yet: memory only, so admitting and ending a call writes nothing more.
Every ``INTERVAL`` its loop gives the attempts of the calls in flight for at least that long a heartbeat: the
running ones in one transaction (``touch_running``), the few others in a second one (``revive_latest``) only when
there are any; no call that old, no write. Each process touches its own calls' attempts, so it works
with any number of gateway processes on one database (a process that dies stops touching with it). What the
heartbeat does to an attempt, and the statements, are in ``store.sql.keepalive``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from sqlalchemy import Connection

from rollway.store.errors import UnavailableError
from rollway.store.sql.keepalive import revive_latest, touch_running

log = logging.getLogger("rollway.store")

#: Seconds between two rounds, and how long a call must have been in flight to count: a call's attempt gets a
#: heartbeat at most twice ``INTERVAL`` after the call arrived, then every ``INTERVAL`` until its span is written.
INTERVAL = 0.5
T = TypeVar("T")


class Write(Protocol):
    """The store's write path: runs an operation in a write transaction (``Store._write``)."""

    def __call__(self, op: Callable[[Connection], T], /) -> Awaitable[T]: ...


class CallsInFlight:
    """The calls this process admitted whose span is not written yet, by (rollout id, attempt id, sequence id),
    with the time each arrived; and the loop that keeps their attempts alive."""

    def __init__(
        self,
        write: Write,
        clock: Callable[[], float],
        interval: float = INTERVAL,
    ) -> None:
        self._write = write
        self._clock = clock
        self.interval = interval
        self.calls: dict[tuple[str, str, int], float] = {}

    def add(self, rollout_id: str, attempt_id: str, sequence_id: int) -> None:
        self.calls[(rollout_id, attempt_id, sequence_id)] = time.monotonic()

    def remove(self, rollout_id: str, attempt_id: str, sequence_id: int) -> None:
        self.calls.pop((rollout_id, attempt_id, sequence_id), None)

    def due(self, min_age: float) -> list[tuple[str, str]]:
        """(rollout id, attempt id) of each attempt with a call in flight for at least ``min_age`` seconds."""
        since = time.monotonic() - min_age
        return sorted({(rollout_id, attempt_id) for (rollout_id, attempt_id, _), t in self.calls.items() if t <= since})

    async def keep_alive(self, min_age: float | None = None) -> int:
        """One round: a heartbeat for the attempts of the calls in flight for at least ``min_age`` (default: the
        interval); how many attempts got one. No such call, no write."""
        targets = self.due(self.interval if min_age is None else min_age)
        if not targets:
            return 0
        # The time is read when each transaction runs: a span written just before it is not given an older one.
        ids = sorted({attempt_id for _, attempt_id in targets})
        touched = await self._write(lambda conn: touch_running(conn, ids, self._clock()))
        rest = [(rollout_id, attempt_id) for rollout_id, attempt_id in targets if attempt_id not in touched]
        if not rest:
            return len(touched)
        # The others in a transaction of their own, once the touched attempts are committed: ``revive`` waits for
        # rollout locks, and a writer holding one of those rollouts may be waiting for a touched attempt (a sweep
        # locks rollouts, then their attempts; another replica's round, rollout and attempt in turn) — on
        # PostgreSQL a deadlock, broken after a second with every call of those rollouts waiting behind it.
        return len(touched) + await self._write(lambda conn: revive_latest(conn, rest, self._clock()))

    async def run(self) -> None:
        """The loop: a round every ``interval`` (one of the store's loops, cancelled when it closes)."""
        failing = False
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.keep_alive()
            except Exception as exc:  # the store is down or locked for long: said once, tried again next round
                if not failing:
                    why = exc.message if isinstance(exc, UnavailableError) else None  # (the driver's words suffice)
                    message = "could not give the attempts of calls in flight their heartbeat"
                    log.error("%s: %s", message, why, exc_info=why is None)
                failing = True
            else:
                failing = False
