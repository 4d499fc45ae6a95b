"""Attempt outcomes and their propagation to the rollout (the transition tables of ``store.states``, applied).

Every function here runs inside a write transaction. Row locks are always taken rollout first, then
attempt, then span sequence, so concurrent operations on PostgreSQL cannot deadlock each other.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, RowMapping, bindparam, select, update

from rollway.store.db import models
from rollway.store.db.dialect import upsert
from rollway.store.errors import ConflictError, NotFoundError
from rollway.store.schemas import RolloutConfig
from rollway.store.states import (
    ATTEMPT_TERMINAL,
    FINISHED,
    FROZEN,
    REVIVED_BY_SPAN,
    AttemptStatus,
    RolloutStatus,
    check_attempt_change,
    check_rollout_transition,
    rollout_status_for_attempt,
)

R = models.rollouts
A = models.attempts
FINISH_COUNTER = "rollout_finish_seq"


# Hot-path statements are built once (their compiled forms are then cached by SQLAlchemy). FOR UPDATE
# locks the rows on PostgreSQL; SQLite's compiler leaves it out (its single writer already excludes others).
_ROLLOUT = select(R).where(R.c.rollout_id == bindparam("rollout_id"))
_ROLLOUT_LOCKED = _ROLLOUT.with_for_update()
_ATTEMPT = select(A).where(A.c.attempt_id == bindparam("attempt_id"), A.c.rollout_id == bindparam("rollout_id"))
_ATTEMPT_LOCKED = _ATTEMPT.with_for_update()


def load_rollout(conn: Connection, rollout_id: str, *, lock: bool = True) -> RowMapping:
    stmt = _ROLLOUT_LOCKED if lock else _ROLLOUT
    row: RowMapping | None = conn.execute(stmt, {"rollout_id": rollout_id}).mappings().first()
    if row is None:
        raise NotFoundError(f"rollout '{rollout_id}' not found")
    return row


def load_attempt(conn: Connection, rollout: RowMapping, attempt_id: str, *, lock: bool = True) -> RowMapping:
    """The attempt ``attempt_id`` (or ``latest``) of ``rollout``."""
    if attempt_id == "latest":
        if rollout["latest_attempt_id"] is None:
            raise NotFoundError(f"rollout '{rollout['rollout_id']}' has no attempts")
        attempt_id = rollout["latest_attempt_id"]
    stmt = _ATTEMPT_LOCKED if lock else _ATTEMPT
    params = {"attempt_id": attempt_id, "rollout_id": rollout["rollout_id"]}
    row: RowMapping | None = conn.execute(stmt, params).mappings().first()
    if row is None:
        raise NotFoundError(f"attempt '{attempt_id}' of rollout '{rollout['rollout_id']}' not found")
    return row


def require_latest(rollout: RowMapping, attempt: RowMapping) -> None:
    """Refuse a write to an attempt that a newer attempt has replaced."""
    if rollout["latest_attempt_id"] != attempt["attempt_id"]:
        raise ConflictError(
            f"attempt '{attempt['attempt_id']}' of rollout '{rollout['rollout_id']}' is stale: "
            f"the latest attempt is '{rollout['latest_attempt_id']}'"
        )


def bump_counter(conn: Connection, name: str) -> int:
    """Move the named counter (``counters``) forward by one, creating it at 1; its new value."""
    stmt = upsert(conn, models.counters).values(name=name, value=1)
    stmt = stmt.on_conflict_do_update(index_elements=["name"], set_={"value": models.counters.c.value + 1})
    return int((conn.execute(stmt.returning(models.counters.c.value))).scalar_one())


def next_finish_seq(conn: Connection) -> int:
    """The next position in the order rollouts finish (for incremental exports)."""
    return bump_counter(conn, FINISH_COUNTER)


def set_rollout_status(
    conn: Connection, rollout: RowMapping, status: RolloutStatus, now: float, *, check: bool = True
) -> RolloutStatus:
    """Move ``rollout`` to ``status`` with the side effects the status implies."""
    current = RolloutStatus(rollout["status"])
    if status == current:
        return current
    if check:
        check_rollout_transition(current, status)
    values: dict[str, Any] = {"status": status.value, "updated_time": now}
    if status in FINISHED:
        values["end_time"] = now
        values["finish_seq"] = next_finish_seq(conn)
        values["queue_time"] = None
    elif status == RolloutStatus.REQUEUING:
        values["end_time"] = None
        values["finish_seq"] = None
        values["queue_time"] = now
    else:
        values["end_time"] = None
        values["finish_seq"] = None
        values["queue_time"] = None
    conn.execute(update(R).where(R.c.pk == rollout["pk"]).values(**values))
    return status


def apply_attempt_status(
    conn: Connection,
    rollout: RowMapping,
    attempt: RowMapping,
    status: AttemptStatus,
    now: float,
) -> None:
    """Set an attempt's status and, when it is the latest attempt, propagate it to the rollout."""
    current = AttemptStatus(attempt["status"])
    check_attempt_change(RolloutStatus(rollout["status"]), current, status)
    if status == current:
        return
    values: dict[str, Any] = {"status": status.value}
    if status in ATTEMPT_TERMINAL:
        values["end_time"] = now
    conn.execute(update(A).where(A.c.pk == attempt["pk"]).values(**values))
    sync_worker(conn, attempt["worker_id"], rollout["rollout_id"], attempt["attempt_id"], status, now)
    if rollout["latest_attempt_id"] != attempt["attempt_id"]:
        return
    config = RolloutConfig.model_validate(rollout["config"])
    target = rollout_status_for_attempt(status, attempt["sequence_id"], config.max_attempts, config.retry_condition)
    set_rollout_status(conn, rollout, target, now)


# Built once: a heartbeat runs with every span batch and gateway call, and building the statement costs more
# than running it.
_HEARTBEAT = update(A).where(A.c.pk == bindparam("apk")).values(last_heartbeat_time=bindparam("now"))
_REVIVE = _HEARTBEAT.values(status=AttemptStatus.RUNNING.value)


def record_heartbeat(conn: Connection, rollout: RowMapping, attempt: RowMapping, now: float) -> None:
    """A span or heartbeat: refresh liveness, revive ``preparing``/``unresponsive`` to ``running``.

    A heartbeat never revives ``timeout``, ``failed`` or ``succeeded``, nor the attempt of a cancelled rollout
    (``FROZEN``: a span of a call still in flight is kept, the attempt's status is not changed). The rollout
    follows to ``running`` only from ``preparing``/``queuing``/``requeuing`` and only for its latest attempt.
    """
    revived = AttemptStatus(attempt["status"]) in REVIVED_BY_SPAN and rollout["status"] not in FROZEN
    conn.execute(_REVIVE if revived else _HEARTBEAT, {"apk": attempt["pk"], "now": now})
    if not revived or rollout["latest_attempt_id"] != attempt["attempt_id"]:
        return
    sync_worker(conn, attempt["worker_id"], rollout["rollout_id"], attempt["attempt_id"], AttemptStatus.RUNNING, now)
    if rollout["status"] in (RolloutStatus.PREPARING, RolloutStatus.QUEUING, RolloutStatus.REQUEUING):
        set_rollout_status(conn, rollout, RolloutStatus.RUNNING, now, check=False)


def sync_worker(
    conn: Connection,
    worker_id: str | None,
    rollout_id: str,
    attempt_id: str,
    status: AttemptStatus,
    now: float,
) -> None:
    """Keep the worker's view (idle/busy/unknown) in step with the attempt it runs."""
    if not worker_id:
        return
    values: dict[str, Any]
    if status in (AttemptStatus.SUCCEEDED, AttemptStatus.FAILED):
        values = {
            "status": "idle",
            "last_idle_time": now,
            "current_rollout_id": None,
            "current_attempt_id": None,
        }
    elif status in (AttemptStatus.TIMEOUT, AttemptStatus.UNRESPONSIVE):
        values = {
            "status": "unknown",
            "last_idle_time": now,
            "current_rollout_id": None,
            "current_attempt_id": None,
        }
    else:
        values = {
            "status": "busy",
            "last_busy_time": now,
            "current_rollout_id": rollout_id,
            "current_attempt_id": attempt_id,
        }
    stmt = upsert(conn, models.workers).values(worker_id=worker_id, **values)
    conn.execute(stmt.on_conflict_do_update(index_elements=["worker_id"], set_=values))
