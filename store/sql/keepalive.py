"""The heartbeat of the LLM calls in flight, as statements (``store.parts.keepalive`` keeps the record of those
calls and runs these every round): ``touch_running`` for the running attempts, in one statement, and
``revive_latest`` for the few others.

The heartbeat is a span's (``store.sql.lifecycle.record_heartbeat``): a running attempt's
``last_heartbeat_time`` moves on, a ``preparing`` attempt (its first call in flight) or an ``unresponsive`` one
moves to ``running`` with its rollout (out of the queue, if it was requeued). An attempt a newer one replaced, an
attempt that ended (``timeout`` included: nothing extends the rollout's deadline) and a finished rollout are left
alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Connection, and_, bindparam, select, update

from rollway.store.db import models
from rollway.store.errors import NotFoundError
from rollway.store.sql.lifecycle import load_attempt, load_rollout, record_heartbeat
from rollway.store.states import ATTEMPT_TERMINAL, FINISHED, AttemptStatus, RolloutStatus

R = models.rollouts
A = models.attempts

CHUNK = 500  # attempt ids per statement


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
