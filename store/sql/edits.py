"""Edits of stored rollouts and workers that compatibility layers need (Agent-lightning's ``update_rollout``
and ``update_worker``), and the latest attempt of many rollouts in one read.

A field left out of an edit is unchanged; a status goes through the same transition table and side effects
as every other status change (``store.sql.lifecycle.set_rollout_status``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, select, update

from rollway.store.db import models
from rollway.store.db.dialect import upsert
from rollway.store.errors import ConflictError, StoreValidationError
from rollway.store.schemas import Attempt, Rollout, RolloutConfig, Worker
from rollway.store.sql import convert
from rollway.store.sql import resources as resources_ops
from rollway.store.sql.lifecycle import load_rollout, set_rollout_status
from rollway.store.states import ACTIVE, AttemptStatus, RolloutStatus

R = models.rollouts
A = models.attempts
W = models.workers

#: Attempt statuses a rollout's ``preparing``/``running`` can stand for (``unresponsive``: a span revives it).
LIVE_ATTEMPT = frozenset({AttemptStatus.PREPARING, AttemptStatus.RUNNING, AttemptStatus.UNRESPONSIVE})

ROLLOUT_FIELDS = frozenset({"input", "mode", "resources_id", "status", "config", "metadata"})


def update_rollout(conn: Connection, rollout_id: str, changes: dict[str, Any], now: float) -> Rollout:
    """Apply ``changes`` (a subset of ``ROLLOUT_FIELDS``) to a rollout."""
    unknown = set(changes) - ROLLOUT_FIELDS
    if unknown:
        raise StoreValidationError(f"rollout fields cannot be changed: {', '.join(sorted(unknown))}")
    rollout = load_rollout(conn, rollout_id)
    values: dict[str, Any] = {}
    if "input" in changes:
        values["input"] = changes["input"]
    if "mode" in changes:
        if changes["mode"] not in (None, "train", "val", "test"):
            raise StoreValidationError(f"unknown mode '{changes['mode']}'")
        values["mode"] = changes["mode"]
    if "resources_id" in changes:
        rid = changes["resources_id"]
        if rid is not None and not resources_ops.exists(conn, rid):
            raise StoreValidationError(f"resources '{rid}' not found")
        values["resources_id"] = rid
    if "config" in changes:
        config = changes["config"]
        if config is None:
            raise StoreValidationError("config cannot be null")
        values["config"] = RolloutConfig.model_validate(config).model_dump(mode="json")
    if "metadata" in changes:
        metadata = changes["metadata"]
        if metadata is not None and not isinstance(metadata, dict):
            raise StoreValidationError("rollout metadata must be an object")
        values["metadata"] = metadata
    if values:
        values["updated_time"] = now
        conn.execute(update(R).where(R.c.pk == rollout["pk"]).values(**values))
    if "status" in changes:
        try:
            status = RolloutStatus(changes["status"])
        except ValueError as exc:
            raise StoreValidationError(f"unknown rollout status '{changes['status']}'") from exc
        rollout = load_rollout(conn, rollout_id)
        if status in ACTIVE:
            _require_live_attempt(conn, rollout, status)
        set_rollout_status(conn, rollout, status, now)
    return convert.rollout(load_rollout(conn, rollout_id, lock=False))


def _require_live_attempt(conn: Connection, rollout: Any, status: RolloutStatus) -> None:
    """``preparing`` and ``running`` mirror the rollout's latest attempt; an edit sets them only while that attempt
    is live. On a queued rollout (no attempt) or a finished one (its attempt over) nothing would move the rollout
    on again: out of the queue, nothing for the watchdog to judge, calls refused — it would wait for ever. A new
    attempt is a claim or ``start_attempt``."""
    latest = rollout["latest_attempt_id"]
    current = None
    if latest is not None:
        current = conn.execute(select(A.c.status).where(A.c.attempt_id == latest)).scalar()
    if current not in LIVE_ATTEMPT:
        has = "no attempt" if current is None else f"its latest attempt is {current}"
        raise ConflictError(
            f"rollout '{rollout['rollout_id']}' cannot be set {status}: {has} (claim it or start an attempt)"
        )


def update_worker(conn: Connection, worker_id: str, heartbeat_stats: Any, now: float, *, set_stats: bool) -> Worker:
    """A worker's heartbeat (creates the worker when new); ``set_stats`` also replaces its stats."""
    if not worker_id:
        raise StoreValidationError("worker_id must not be empty")
    if set_stats and heartbeat_stats is not None and not isinstance(heartbeat_stats, dict):
        raise StoreValidationError("heartbeat_stats must be an object")
    values: dict[str, Any] = {"last_heartbeat_time": now}
    if set_stats:
        values["heartbeat_stats"] = heartbeat_stats
    stmt = upsert(conn, W).values(worker_id=worker_id, **values)
    conn.execute(stmt.on_conflict_do_update(index_elements=["worker_id"], set_=values))
    row = conn.execute(select(W).where(W.c.worker_id == worker_id)).mappings().one()
    return Worker.model_validate(dict(row))


def latest_attempts(conn: Connection, rollout_ids: Sequence[str]) -> dict[str, Attempt]:
    """``{rollout_id: latest attempt}`` for the rollouts among ``rollout_ids`` that have one."""
    out: dict[str, Attempt] = {}
    ids = list(dict.fromkeys(rollout_ids))
    for start in range(0, len(ids), 500):
        chunk = ids[start : start + 500]
        stmt = select(A).join(R, (R.c.rollout_id == A.c.rollout_id) & (R.c.latest_attempt_id == A.c.attempt_id))
        for row in conn.execute(stmt.where(R.c.rollout_id.in_(chunk))).mappings():
            out[row["rollout_id"]] = convert.attempt(row)
    return out
