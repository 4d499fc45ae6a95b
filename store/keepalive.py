"""A call in flight is a heartbeat. Every span is one, but an LLM call's span is written when the call ends (it
holds the answer), so a call longer than its rollout's ``unresponsive_seconds`` (a long generation, a call
waiting out a paused alias) would leave its attempt silent: the watchdog would mark it ``unresponsive`` and
requeue a rollout that is still running, for another worker to run again.

``CallsInFlight`` is this process's record of the calls ``Store.begin_call`` admitted whose span
``Store.record_call`` has not written yet: memory only, so admitting and ending a call writes nothing more.
Every ``INTERVAL`` its loop gives the attempts of the calls in flight for at least that long a heartbeat: the
running ones in one transaction (``touch_running``), the few others in a second one (``revive_latest``) only when
there are any; no call that old, no write. Each process touches its own calls' attempts, so it works
with any number of gateway processes on one database (a process that dies stops touching with it).

The heartbeat is a span's (``lifecycle.record_heartbeat``): a running attempt's ``last_heartbeat_time`` moves
on, a ``preparing`` attempt (its first call in flight) or an ``unresponsive`` one moves to ``running`` with its
rollout (out of the queue, if it was requeued). An attempt a newer one replaced, an attempt that ended
(``timeout`` included: nothing extends the rollout's deadline) and a finished rollout are left alone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, TypeVar

from sqlalchemy import Connection, and_, bindparam, select, update

from rollway.store.db import models
from rollway.store.errors import NotFoundError, UnavailableError
from rollway.store.sql.lifecycle import load_attempt, load_rollout, record_heartbeat
from rollway.store.states import ATTEMPT_TERMINAL, FINISHED, AttemptStatus, RolloutStatus

log = logging.getLogger("rollway.store")

R = models.rollouts
A = models.attempts

#: Seconds between two rounds, and how long a call must have been in flight to count: a call's attempt gets a
#: heartbeat at most twice ``INTERVAL`` after the call arrived, then every ``INTERVAL`` until its span is written.
INTERVAL = 0.5
CHUNK = 500
T = TypeVar("T")


class Write(Protocol):
    """The store's write path: runs an operation in a write transaction (``Store._write``)."""

    def __call__(self, op: Callable[[Connection], T], /) -> Awaitable[T]: ...


# The running latest attempts of running rollouts among the ids: the common case, one statement. On PostgreSQL
# the rows are locked SKIP LOCKED (an attempt another transaction is writing takes the general path instead).
_RUNNING = (
    select(A.c.pk)
    .join(R, and_(R.c.rollout_id == A.c.rollout_id, R.c.latest_attempt_id == A.c.attempt_id))
    .where(
        A.c.attempt_id.in_(bindparam("ids", expanding=True)),
        A.c.status == AttemptStatus.RUNNING.value,
        R.c.status == RolloutStatus.RUNNING.value,
    )
)


def touch_running(conn: Connection, attempt_ids: Sequence[str], now: float) -> set[str]:
    """Move ``last_heartbeat_time`` of those of ``attempt_ids`` that are the running latest attempt of a running
    rollout to ``now``; the ids it moved."""
    rows = _RUNNING.with_for_update(of=A, skip_locked=True) if conn.dialect.name == "postgresql" else _RUNNING
    stmt = update(A).where(A.c.pk.in_(rows)).values(last_heartbeat_time=bindparam("now")).returning(A.c.attempt_id)
    touched: set[str] = set()
    for start in range(0, len(attempt_ids), CHUNK):
        chunk = list(attempt_ids[start : start + CHUNK])
        touched.update(conn.execute(stmt, {"ids": chunk, "now": now}).scalars())
    return touched


def revive(conn: Connection, targets: Sequence[tuple[str, str]], now: float) -> int:
    """The heartbeat of a span for each (rollout id, attempt id) that is its live rollout's latest attempt and has
    not ended (``preparing`` or ``unresponsive`` → ``running``); rows locked rollout, then attempt, in rollout
    order. How many got it."""
    revived = 0
    for rollout_id, attempt_id in sorted(targets):
        try:
            rollout = load_rollout(conn, rollout_id)
            attempt = load_attempt(conn, rollout, attempt_id)
        except NotFoundError:
            continue
        if (
            rollout["latest_attempt_id"] != attempt_id
            or rollout["status"] in FINISHED
            or attempt["status"] in ATTEMPT_TERMINAL
        ):
            continue
        record_heartbeat(conn, rollout, attempt, now)
        revived += 1
    return revived


def revive_latest(conn: Connection, targets: Sequence[tuple[str, str]], now: float) -> int:
    """``revive`` those of ``targets`` that are their rollout's latest attempt. Attempts a newer one replaced are
    left out before any lock is taken: a stale call does not lock its rollout every round."""
    wanted = sorted({rollout_id for rollout_id, _ in targets})
    query = select(R.c.rollout_id, R.c.latest_attempt_id).where(R.c.rollout_id.in_(wanted))
    latest = {rollout_id: attempt_id for rollout_id, attempt_id in conn.execute(query)}
    return revive(
        conn,
        [(rollout_id, attempt_id) for rollout_id, attempt_id in targets if latest.get(rollout_id) == attempt_id],
        now,
    )


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

    def arrived(self, rollout_id: str, attempt_id: str, sequence_id: int) -> None:
        self.calls[(rollout_id, attempt_id, sequence_id)] = time.monotonic()

    def ended(self, rollout_id: str, attempt_id: str, sequence_id: int) -> None:
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
