"""Rollouts an outside controller drives (``store.controlled``): creation, the controller's changes applied to
Rollway's rollouts and attempts in one transaction each, the log of the order they ended, and their events. The
models and the pause of the proxy their agents call through are ``store.sql.proxy``.

- A rollout is a Rollway rollout (``agent = CONTROLLER_AGENT``, one attempt, no watchdog timeout: the controller
  enforces its own) plus a ``controlled_rollouts`` row with what the controller set and a version that moves on
  every change.
- ``queuing → running`` starts the rollout's attempt; ``running → succeeded | failed`` ends it;
  ``queuing → failed`` starts and fails it. The first terminal transition, whoever makes it (a PATCH, a cancel
  through the admin API), gives the rollout its place in the terminal log (``terminal_seq``, from 1 without gaps:
  a counter moved in the same transaction). A reward written later leaves that place as it is.
- A delete hides the rollout from the controller's API; the Rollway rollout and its spans stay.
- An event becomes a span of the rollout's attempt, labelled with the controller's attempt id; a ``reward`` event
  with a number is a Rollway reward span. Events posted before the rollout started wait in the row
  (``early_events``) and are shown first.
"""

from __future__ import annotations

import contextlib
import math
import uuid
from typing import Any

from sqlalchemy import Connection, RowMapping, func, select, update

from rollway.store.controlled import (
    ATTEMPT_ATTR,
    CONTROLLER_AGENT,
    DATA_ATTR,
    STATUSES_OF,
    TERMINAL,
    TRANSITIONS,
    TYPE_ATTR,
    ControlledCreate,
    ControlledPatch,
    ControlledRollout,
    View,
)
from rollway.store.db import models
from rollway.store.errors import ConflictError, NotFoundError
from rollway.store.schemas import RolloutConfig, TaskSpec
from rollway.store.sql import agents, convert, enqueue, queue, spans
from rollway.store.sql.lifecycle import apply_attempt_status, bump_counter, load_attempt, load_rollout
from rollway.store.states import AttemptStatus

C = models.controlled_rollouts
R = models.rollouts
TERMINAL_COUNTER = "controlled_terminal"
WORKER = "agl-controller"
EVENT_SPAN = "agl.event"


def _record(row: RowMapping) -> ControlledRollout:
    return ControlledRollout(
        rollout=convert.rollout(row),
        is_train=row["is_train"],
        config=row["c_config"] or {},
        version=row["version"],
        k8s_job_name=row["k8s_job_name"],
        last_attempt_id=row["last_attempt_id"],
        error_message=row["error_message"],
        created_time=row["created_time"],
        updated_time=row["c_updated_time"],
        early_events=row["early_events"] or [],
    )


def _joined() -> Any:
    return select(
        R,
        C.c.is_train,
        C.c.config.label("c_config"),
        C.c.version,
        C.c.k8s_job_name,
        C.c.last_attempt_id,
        C.c.error_message,
        C.c.early_events,
        C.c.created_time,
        C.c.updated_time.label("c_updated_time"),
        C.c.terminal_seq,
    ).join(C, C.c.rollout_id == R.c.rollout_id)


def _find(conn: Connection, rollout_id: str) -> ControlledRollout | None:
    stmt = _joined().where(R.c.rollout_id == rollout_id, C.c.deleted_time.is_(None))
    row = conn.execute(stmt).mappings().first()
    return None if row is None else _record(row)


def get(conn: Connection, rollout_id: str) -> ControlledRollout:
    found = _find(conn, rollout_id)
    if found is None:
        raise NotFoundError(f"Rollout not found: {rollout_id}")
    return found


def live(conn: Connection, rollout_id: str) -> bool:
    """Whether ``rollout_id`` is a controlled rollout that is not deleted (what the proxy serves)."""
    stmt = select(C.c.rollout_id).where(C.c.rollout_id == rollout_id, C.c.deleted_time.is_(None))
    return conn.execute(stmt).first() is not None


def create(conn: Connection, items: list[ControlledCreate], now: float) -> list[ControlledRollout]:
    """Create each rollout, in order; an id that exists returns the stored rollout unchanged (whatever its state).
    An id taken by a rollout the controller did not create, or by one deleted, is a conflict."""
    out: list[ControlledRollout] = []
    for item in items:
        rollout_id = item.rollout_id or uuid.uuid4().hex
        if item.rollout_id is not None:
            taken = conn.execute(select(C.c.deleted_time).where(C.c.rollout_id == rollout_id)).first()
            if taken is not None:
                if taken[0] is not None:
                    raise ConflictError(f"rollout '{rollout_id}' was deleted: create it under a new id")
                out.append(get(conn, rollout_id))
                continue
            if conn.execute(select(R.c.pk).where(R.c.rollout_id == rollout_id)).first() is not None:
                raise ConflictError(f"rollout '{rollout_id}' exists and was not created through /api/rollouts")
        spec = TaskSpec(
            rollout_id=rollout_id,
            input=item.input,
            mode="train" if item.is_train else "val",
            config=RolloutConfig(max_attempts=1),
            metadata=item.metadata,
            agent=CONTROLLER_AGENT,
        )
        enqueue.enqueue(conn, [spec], now)
        row = {
            "rollout_id": rollout_id,
            "is_train": item.is_train,
            "config": item.config,
            "version": 1,
            "early_events": [],
            "created_time": now,
            "updated_time": now,
        }
        conn.execute(C.insert().values(**row))
        out.append(get(conn, rollout_id))
    return out


def listing(conn: Connection, views: set[View], limit: int) -> list[ControlledRollout]:
    """The rollouts in one of ``views``, oldest first, the first ``limit``."""
    statuses = [s.value for view in views for s in STATUSES_OF[view]]
    stmt = _joined().where(C.c.deleted_time.is_(None), R.c.status.in_(statuses)).order_by(R.c.pk).limit(max(limit, 0))
    return [_record(row) for row in conn.execute(stmt).mappings()]


def ended(conn: Connection, rollout_id: str) -> None:
    """Give a controlled rollout that just ended its place in the terminal log (once; no-op for others)."""
    stmt = select(C.c.terminal_seq).where(C.c.rollout_id == rollout_id)
    row = conn.execute(stmt).first()
    if row is None or row[0] is not None:
        return
    seq = bump_counter(conn, TERMINAL_COUNTER)
    conn.execute(update(C).where(C.c.rollout_id == rollout_id).values(terminal_seq=seq))


def locked(conn: Connection, rollout_id: str) -> ControlledRollout:
    """The rollout as ``get`` reads it, its row locked first (``FOR UPDATE`` on PostgreSQL; SQLite's single writer
    already serialises), and first of all the rows a write locks, as ``store.sql.lifecycle`` orders them: a write
    that reads and then changes it waits for any other doing the same, and cannot deadlock with one."""
    with contextlib.suppress(NotFoundError):  # (an unknown rollout: ``get`` says so, in its own words)
        load_rollout(conn, rollout_id)
    return get(conn, rollout_id)


def patch(conn: Connection, rollout_id: str, change: ControlledPatch, now: float) -> ControlledRollout:
    """Apply a controller's change (``change.model_fields_set``); an empty one changes nothing. The rollout is read
    locked (``locked``): two changes at once are checked against the transition table one after the other."""
    current = locked(conn, rollout_id)
    named = change.model_fields_set
    if not named:
        return current
    if "state" in named:
        target = change.state
        if target is None or target not in TRANSITIONS[current.state]:
            raise ConflictError(f"Rollout {rollout_id}: cannot transition {current.state} -> {target}")
        _move(conn, rollout_id, current.state, target, now)
        if target in TERMINAL:
            ended(conn, rollout_id)
    values: dict[str, Any] = {name: getattr(change, name) for name in named if name != "state"}
    values |= {"version": C.c.version + 1, "updated_time": now}
    conn.execute(update(C).where(C.c.rollout_id == rollout_id).values(**values))
    return get(conn, rollout_id)


def _move(conn: Connection, rollout_id: str, current: View, target: View, now: float) -> None:
    """The Rollway side of a view transition: start the attempt, end it, or both."""
    if current == "queuing":
        queue.start_attempt(conn, rollout_id, WORKER, now)
        if target == "running":
            return
    rollout = load_rollout(conn, rollout_id)
    attempt = load_attempt(conn, rollout, "latest")
    status = AttemptStatus.SUCCEEDED if target == "succeeded" else AttemptStatus.FAILED
    apply_attempt_status(conn, rollout, attempt, status, now)


def remove(conn: Connection, rollout_id: str, now: float) -> None:
    """Hide a rollout from the controller's API (a rollout unknown or hidden already: nothing)."""
    stmt = update(C).where(C.c.rollout_id == rollout_id, C.c.deleted_time.is_(None)).values(deleted_time=now)
    conn.execute(stmt)


def terminal(conn: Connection, after: int, limit: int) -> tuple[list[ControlledRollout], int, int]:
    """Positions ``after`` … ``after + limit - 1`` of the terminal log: (the rollouts there that are not deleted,
    the next position, the log's length)."""
    total = int(conn.execute(select(func.count()).where(C.c.terminal_seq.is_not(None))).scalar_one())
    if after >= total:  # past the log's end (``after + limit`` could also overflow the database's integers)
        return [], after, total
    stmt = (
        _joined()
        .where(C.c.terminal_seq > after, C.c.terminal_seq <= after + limit, C.c.deleted_time.is_(None))
        .order_by(C.c.terminal_seq)
    )
    items = [_record(row) for row in conn.execute(stmt).mappings()]
    return items, after + max(0, min(limit, total - after)), total


def add_event(
    conn: Connection, rollout_id: str, attempt_label: str, event_type: str, data: dict[str, Any], now: float
) -> None:
    """Keep one posted event: a span of the rollout's attempt, or an early event while it has none. The rollout is
    read locked (``locked``): early events posted at once each extend the list the one before wrote, and none is
    lost."""
    current = locked(conn, rollout_id)
    event = {"event_type": event_type, "attempt_id": attempt_label, "timestamp": now, "data": data}
    if current.rollout.attempt_count == 0:
        early = [*current.early_events, event]
        conn.execute(update(C).where(C.c.rollout_id == rollout_id).values(early_events=early))
        return
    attributes: dict[str, Any] = {ATTEMPT_ATTR: attempt_label, TYPE_ATTR: event_type, DATA_ATTR: data}
    if event_type == "reward" and (reward := _finite(data.get("value"))) is not None:
        span = agents.reward_span(rollout_id, None, reward, now, **attributes)
    else:
        span = spans.point_span(rollout_id, None, EVENT_SPAN, attributes, now)
    spans.add(conn, [span], now)


def _finite(value: Any) -> float | None:
    """``value`` as a reward: a finite number (not a bool), else None."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def attempt_labels(conn: Connection, rollout_id: str) -> list[str]:
    """The controller's attempt ids that have events, ordered by their first event."""
    current = get(conn, rollout_id)
    S = models.spans
    label = S.c.attributes[ATTEMPT_ATTR].as_string()
    stmt = (
        select(label, func.min(S.c.start_time)).where(S.c.rollout_id == rollout_id, label.is_not(None)).group_by(label)
    )
    first: dict[str, float] = {}
    for event in current.early_events:
        first.setdefault(event["attempt_id"], event["timestamp"])
    for name, when in conn.execute(stmt):
        first[name] = min(first.get(name, when or 0.0), when or 0.0)
    return sorted(first, key=lambda name: first[name])
