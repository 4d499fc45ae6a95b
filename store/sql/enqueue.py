"""Enqueue: the rollouts a request's tasks stand for (groups expanded, ids derived from an idempotency key),
inserted idempotently by client ``rollout_id``; a repeated key returns what its first request queued
(``store.sql.replays``)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, RowMapping, select

from rollway.store import ids
from rollway.store.db import models
from rollway.store.db.dialect import serialize_key, upsert
from rollway.store.errors import StoreValidationError
from rollway.store.schemas import RolloutConfig, TaskSpec
from rollway.store.sql import groups, replays
from rollway.store.sql import resources as resources_ops
from rollway.store.states import QUEUED, RolloutStatus

R = models.rollouts


def expand(spec: TaskSpec, key: tuple[str, int] | None = None) -> list[tuple[str | None, str | None, int | None]]:
    """(rollout_id, group_id, group_index) for each rollout a task stands for. With ``key`` (the request's
    idempotency key and the task's position in it), ids the client left out are derived from it."""
    size = spec.group_size or 1
    rollout_id = spec.rollout_id
    if rollout_id is None and key is not None:
        derived = [ids.derived("ro-", key[0], key[1], i) for i in range(size)]
        group = spec.group_id or (ids.derived("gr-", *key) if size > 1 else None)
        return [(rid, group, i if group else None) for i, rid in enumerate(derived)]
    if size == 1:
        return [(rollout_id, spec.group_id, 0 if spec.group_id else None)]
    longest = len(f"{rollout_id}-{size - 1}") if rollout_id else 0
    if longest > 128:  # (a declared member, or a start, keeps its own id)
        raise StoreValidationError(
            f"rollout_id is too long for group_size {size}: the task's rollouts are named '<rollout_id>-<i>', "
            f"at most 128 characters ({longest} here)"
        )
    group = spec.group_id or (f"{rollout_id}" if rollout_id else ids.group_id())
    return [(f"{rollout_id}-{i}" if rollout_id else None, group, i) for i in range(size)]


def resources_for(conn: Connection, specs: list[TaskSpec]) -> str | None:
    """Check the named resources exist; return the latest id for tasks that name none."""
    named = {s.resources_id for s in specs if s.resources_id}
    for rid in named:
        if not resources_ops.exists(conn, rid):
            raise StoreValidationError(f"resources '{rid}' not found")
    if all(s.resources_id for s in specs):
        return None
    return resources_ops.latest_id(conn)


def rollout_row(
    spec: TaskSpec,
    rollout_id: str,
    group: tuple[str | None, int | None],
    status: RolloutStatus,
    latest_resources: str | None,
    now: float,
) -> dict[str, Any]:
    group_id, group_index = group
    return {
        "rollout_id": rollout_id,
        "input": spec.input,
        "mode": spec.mode,
        "resources_id": spec.resources_id or latest_resources,
        "status": status.value,
        "config": (spec.config or RolloutConfig()).model_dump(mode="json"),
        "metadata": spec.metadata,
        "group_id": group_id,
        "group_size": (spec.group_size or 1) if group_id else None,
        "group_index": group_index,
        "priority": spec.priority,
        "agent": spec.agent,
        "start_time": now,
        "end_time": None,
        "queue_time": now if status in QUEUED else None,
        "finish_seq": None,
        "attempt_count": 0,
        "latest_attempt_id": None,
        "updated_time": now,
    }


def enqueue(conn: Connection, specs: list[TaskSpec], now: float, key: str | None = None) -> list[RowMapping]:
    """Insert the rollouts ``specs`` stand for; a client ``rollout_id`` that exists returns the stored one, and
    a repeated idempotency ``key`` returns what its first request queued (``replays.enqueued_before``)."""
    latest = resources_for(conn, specs)
    declared = groups.declared_sizes(specs)  # members of a group of that size: one rollout each
    planned: list[dict[str, Any]] = []
    keyed: list[tuple[dict[str, Any], TaskSpec]] = []  # rows whose ids derive from the key, with their task
    seen: set[str] = set()
    drawn: list[dict[str, Any]] = []  # rows with a random id

    def unseen() -> str:
        while (rid := ids.rollout_id()) in seen:
            pass
        seen.add(rid)
        return rid

    for position, spec in enumerate(specs):
        one = spec.model_copy(update={"group_size": None}) if spec.group_id in declared else spec
        for rollout_id, group_id, group_index in expand(one, None if key is None else (key, position)):
            if rollout_id in seen:
                continue
            rid = rollout_id or unseen()
            seen.add(rid)
            planned.append(rollout_row(one, rid, (group_id, group_index), RolloutStatus.QUEUING, latest, now))
            if rollout_id is None:
                drawn.append(planned[-1])
            if key is not None and not spec.rollout_id:
                keyed.append((planned[-1], spec))
    ids.redraw_taken(conn, R.c.rollout_id, drawn, unseen)
    if any(spec.group_id for spec in specs):
        groups.join(conn, [spec.group_id for spec in specs if spec.group_id], planned, declared)
    if key is None and not any(s.rollout_id for s in specs):
        conn.execute(R.insert(), planned)
        return [as_mapping(r) for r in planned]
    if key is not None:
        serialize_key(conn, key)
        request = replays.enqueue_digest(specs)
        if (earlier := replays.enqueued_before(conn, key, request, specs, planned, keyed)) is not None:
            made = {row["rollout_id"] for row, _ in keyed}
            if not groups.keeps_sizes([r for r in earlier if r["rollout_id"] in made], declared):
                raise replays.other_request(key)
            return earlier
        for row in planned:
            row["request_digest"] = request
    # Idempotent enqueue: skip ids that already exist (a concurrent insert is absorbed by ON CONFLICT).
    conn.execute(upsert(conn, R).on_conflict_do_nothing(index_elements=["rollout_id"]), planned)
    rows = conn.execute(select(R).where(R.c.rollout_id.in_([r["rollout_id"] for r in planned]))).mappings().all()
    by_id = {r["rollout_id"]: r for r in rows}
    return [by_id[r["rollout_id"]] for r in planned]


class _Mapping(dict[str, Any]):
    """A planned row used as a RowMapping (same item access)."""


def as_mapping(row: dict[str, Any]) -> RowMapping:
    """A planned row as a RowMapping, for the callers that read stored rows."""
    return _Mapping(row)  # type: ignore[return-value]
