"""The gateway's view of a rollout when an LLM call arrives: is the attempt live, what is its sequence id,
by when must the call end (the rollout's deadline), and which revision of the model aliases and keys the
call arrived under (``catalog.revision``: a replica that cached an older one reloads before it routes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, bindparam, update

from rollway.store.db import models
from rollway.store.db.dialect import sqlite_driver
from rollway.store.errors import ConflictError, NotFoundError
from rollway.store.schemas import RolloutConfig, Span
from rollway.store.sql import catalog, sequences, spans
from rollway.store.sql.lifecycle import load_attempt, load_rollout, record_heartbeat
from rollway.store.states import ATTEMPT_TERMINAL, FINISHED, AttemptStatus, RolloutStatus

A = models.attempts
_TOUCH_RUNNING = (
    update(A)
    .where(A.c.attempt_id == bindparam("aid"), A.c.status == AttemptStatus.RUNNING.value)
    .values(last_heartbeat_time=bindparam("now"))
)


@dataclass(frozen=True)
class CallTicket:
    """A call's place in its rollout: ids, its sequence id (allocated on arrival), its deadline and the catalog
    revision in force when it arrived."""

    rollout_id: str | None
    attempt_id: str | None
    sequence_id: int
    deadline: float | None = None
    catalog_revision: int = 0


@dataclass(frozen=True)
class Target:
    """What ``begin`` needs of a rollout and one of its attempts (``attempt_*`` None: no such attempt)."""

    rollout_status: str
    latest_attempt_id: str | None
    timeout_seconds: float | None  # the rollout config's; all ``begin`` needs of it
    attempt_id: str | None
    attempt_status: str | None
    attempt_start: float | None
    catalog_revision: int


# SQLite: one statement for the rollout, the attempt and the catalog revision, straight through the driver (a
# call's hot path; the single writer's transaction is the lock). The timeout is read out of the stored config
# (validated when the rollout was enqueued) instead of parsing the whole config per call.
_TARGET_SQLITE = (
    "SELECT r.status, r.latest_attempt_id, json_extract(r.config, '$.timeout_seconds'), a.attempt_id, a.status, "
    f"a.start_time, (SELECT value FROM counters WHERE name = '{catalog.REVISION}') FROM rollouts r "
    "LEFT JOIN attempts a ON a.rollout_id = r.rollout_id AND a.attempt_id = COALESCE(?, r.latest_attempt_id) "
    "WHERE r.rollout_id = ?"
)
_NEXT_SEQUENCE_SQLITE = (
    "INSERT INTO span_sequences (rollout_id, attempt_id, last_value) VALUES (?, ?, 1) "
    "ON CONFLICT (rollout_id, attempt_id) DO UPDATE SET last_value = last_value + 1 RETURNING last_value"
)
_TOUCH_RUNNING_SQLITE = "UPDATE attempts SET last_heartbeat_time = ? WHERE attempt_id = ? AND status = 'running'"


def _load_target(conn: Connection, rollout_id: str, attempt_id: str | None) -> Target:
    raw = sqlite_driver(conn)
    if raw is None:
        rollout = load_rollout(conn, rollout_id)
        try:
            attempt: Any = load_attempt(conn, rollout, attempt_id or "latest")
        except NotFoundError:
            attempt = {"attempt_id": None, "status": None, "start_time": None}
        return Target(
            rollout["status"],
            rollout["latest_attempt_id"],
            RolloutConfig.model_validate(rollout["config"]).timeout_seconds,
            attempt["attempt_id"],
            attempt["status"],
            attempt["start_time"],
            catalog.revision(conn),
        )
    row = raw.execute(_TARGET_SQLITE, (attempt_id, rollout_id)).fetchone()
    if row is None:
        raise NotFoundError(f"rollout '{rollout_id}' not found")
    return Target(row[0], row[1], row[2], row[3], row[4], row[5], int(row[6] or 0))


def begin(conn: Connection, rollout_id: str | None, attempt_id: str | None) -> CallTicket:
    """Check the attempt can take calls and allocate the call's sequence id (``check``)."""
    if not rollout_id:
        _, first = sequences.allocate(conn, None, None)
        return CallTicket(None, None, first, catalog_revision=catalog.revision(conn))
    target = _load_target(conn, rollout_id, attempt_id)
    check(target, rollout_id, attempt_id)
    assert target.attempt_id is not None
    raw = sqlite_driver(conn)
    if raw is None:
        first = sequences.advance(conn, rollout_id, target.attempt_id, 1)
    else:
        first = raw.execute(_NEXT_SEQUENCE_SQLITE, (rollout_id, target.attempt_id)).fetchone()[0]
    timeout = target.timeout_seconds
    deadline = None if timeout is None or target.attempt_start is None else target.attempt_start + timeout
    return CallTicket(rollout_id, target.attempt_id, first, deadline, target.catalog_revision)


def check(target: Target, rollout_id: str, attempt_id: str | None) -> None:
    """Whether an attempt can take calls. Refused (``ConflictError``): a finished rollout, an attempt a newer one
    replaced, an attempt that already ended (succeeded, failed, timed out). An ``unresponsive`` attempt may still
    call: its span revives it."""
    if target.attempt_id is None:
        if attempt_id is None and target.latest_attempt_id is None:
            raise NotFoundError(f"rollout '{rollout_id}' has no attempts")
        raise NotFoundError(f"attempt '{attempt_id}' of rollout '{rollout_id}' not found")
    if target.latest_attempt_id != target.attempt_id:
        raise ConflictError(
            f"attempt '{target.attempt_id}' of rollout '{rollout_id}' is stale: "
            f"the latest attempt is '{target.latest_attempt_id}'"
        )
    if target.rollout_status in FINISHED:
        raise ConflictError(f"rollout '{rollout_id}' is {RolloutStatus(target.rollout_status)}: it takes no more calls")
    if target.attempt_status in ATTEMPT_TERMINAL:
        raise ConflictError(
            f"attempt '{target.attempt_id}' of rollout '{rollout_id}' is {AttemptStatus(target.attempt_status)}: "
            "it takes no more calls"
        )


def record(conn: Connection, span: Span, now: float) -> None:
    """Write the span of a call ``begin`` admitted (its sequence id is already allocated) and count it as a
    heartbeat. The call was admitted while its attempt was live, so its span is kept even if a newer attempt
    replaced that one meanwhile (it happened on the old attempt); only the latest attempt is revived."""
    assert span.sequence_id is not None
    spans.write_spans(conn, [(span, span.rollout_id or "", span.attempt_id or "", span.sequence_id)], now)
    if not span.rollout_id or not span.attempt_id:
        return
    raw = sqlite_driver(conn)
    if raw is not None:
        touched = raw.execute(_TOUCH_RUNNING_SQLITE, (now, span.attempt_id)).rowcount
    else:
        touched = conn.execute(_TOUCH_RUNNING, {"aid": span.attempt_id, "now": now}).rowcount
    if touched == 1:
        return  # the common case: a running attempt, one statement
    revive(conn, span, now)


def revive(conn: Connection, span: Span, now: float) -> None:
    """The heartbeat of a span whose attempt is not running (``unresponsive``): the latest attempt is revived."""
    assert span.rollout_id is not None and span.attempt_id is not None
    rollout = load_rollout(conn, span.rollout_id)
    attempt = load_attempt(conn, rollout, span.attempt_id)
    if rollout["latest_attempt_id"] == attempt["attempt_id"]:
        record_heartbeat(conn, rollout, attempt, now)
