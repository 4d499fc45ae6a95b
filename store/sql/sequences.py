"""Sequence ids: one counter row per (rollout, attempt) in ``span_sequences``, starting at 1, gap-free, in the
order requests reach the store. ``allocate`` reserves ids for spans still to come (the gateway takes one when a
call arrives and writes its span when the call ends); ``advance`` only ever moves a counter forward, past any id
a span brings with it. Spans without a rollout share one counter, under the empty rollout and attempt id."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, Integer, RowMapping, bindparam, case

from rollway.store.db import models
from rollway.store.db.dialect import prebuilt, sqlite_driver, upsert
from rollway.store.errors import StoreValidationError
from rollway.store.sql.lifecycle import load_attempt, load_rollout, require_latest

Q = models.span_sequences
UNATTRIBUTED = ""


def _build_advance(conn: Connection) -> Any:
    """The counter upsert."""
    floor = bindparam("floor", type_=Integer)
    current = case((Q.c.last_value >= floor, Q.c.last_value), else_=floor)
    return (
        upsert(conn, Q)
        .values(rollout_id=bindparam("rid"), attempt_id=bindparam("aid"), last_value=bindparam("initial"))
        .on_conflict_do_update(
            index_elements=["rollout_id", "attempt_id"],
            set_={"last_value": current + bindparam("count", type_=Integer)},
        )
        .returning(Q.c.last_value)
    )


_ADVANCE_SQLITE = (
    "INSERT INTO span_sequences (rollout_id, attempt_id, last_value) VALUES (?, ?, ?) "
    "ON CONFLICT (rollout_id, attempt_id) DO UPDATE SET "
    "last_value = (CASE WHEN last_value >= ? THEN last_value ELSE ? END) + ? RETURNING last_value"
)


def advance(conn: Connection, rollout_id: str, attempt_id: str, count: int, floor: int = 0) -> int:
    """Raise the counter to at least ``floor``, reserve ``count`` ids after it; return the counter's new value."""
    raw = sqlite_driver(conn)
    if raw is not None:
        row = raw.execute(_ADVANCE_SQLITE, (rollout_id, attempt_id, floor + count, floor, floor, count)).fetchone()
        return int(row[0])
    params = {"rid": rollout_id, "aid": attempt_id, "initial": floor + count, "floor": floor, "count": count}
    return int(conn.execute(prebuilt(conn, "advance", _build_advance), params).scalar_one())


def target(conn: Connection, rollout_id: str | None, attempt_id: str | None) -> tuple[RowMapping, RowMapping] | None:
    """The rollout and attempt a span belongs to (locked), or None when unattributed."""
    if not rollout_id:
        if attempt_id:
            raise StoreValidationError("a span with an attempt_id needs a rollout_id")
        return None
    rollout = load_rollout(conn, rollout_id)
    attempt = load_attempt(conn, rollout, attempt_id or "latest")
    require_latest(rollout, attempt)
    return rollout, attempt


def allocate(
    conn: Connection, rollout_id: str | None, attempt_id: str | None, count: int = 1
) -> tuple[str | None, int]:
    """Reserve ``count`` sequence ids; return the attempt id they belong to and the first id."""
    if count < 1:
        raise StoreValidationError("count must be at least 1")
    found = target(conn, rollout_id, attempt_id)
    rid, aid = (UNATTRIBUTED, UNATTRIBUTED) if found is None else (rollout_id or "", found[1]["attempt_id"])
    last = advance(conn, rid, aid, count)
    return (aid or None), last - count + 1
