"""The watchdog: marks attempts ``timeout`` or ``unresponsive`` per their rollout's config.

It is not a per-request cost: each store runs a sweep at most once per interval in the background, and a
debounce row in the database makes the processes sharing one database take turns, so N gateway processes
still sweep about once per interval. A sweep is a single transaction; the rows it changes are locked
(``SKIP LOCKED`` on PostgreSQL) so it never fights a runner's own update.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, select, update

from rollway.store.db import models
from rollway.store.db.dialect import lock_rows, upsert
from rollway.store.schemas import RolloutConfig
from rollway.store.sql.lifecycle import apply_attempt_status
from rollway.store.states import ACTIVE, AttemptStatus

R = models.rollouts
A = models.attempts
C = models.counters
DEBOUNCE = "watchdog_last_sweep"
PROBE = "write_probe"


def claim_turn(conn: Connection, now: float, interval: float) -> bool:
    """True when no process has swept within ``interval``; records this sweep's time."""
    conn.execute(upsert(conn, C).values(name=DEBOUNCE, value=0.0).on_conflict_do_nothing(index_elements=["name"]))
    result = conn.execute(update(C).where(C.c.name == DEBOUNCE, C.c.value <= now - interval).values(value=now))
    return result.rowcount == 1


def probe(conn: Connection, now: float) -> None:
    """A small write that goes through only when the database takes writes (``Store.write_problem``)."""
    row = upsert(conn, C).values(name=PROBE, value=now)
    conn.execute(row.on_conflict_do_update(index_elements=["name"], set_={"value": now}))


def verdict(config: RolloutConfig, start: float, heartbeat: float | None, now: float) -> AttemptStatus | None:
    """What the watchdog makes of a live attempt: timeout first, then unresponsive, else nothing."""
    if config.timeout_seconds is not None and now - start > config.timeout_seconds:
        return AttemptStatus.TIMEOUT
    if config.unresponsive_seconds is not None and now - (heartbeat or start) > config.unresponsive_seconds:
        return AttemptStatus.UNRESPONSIVE
    return None


def _has_limits(config: Any) -> bool:
    return isinstance(config, dict) and (
        config.get("timeout_seconds") is not None or config.get("unresponsive_seconds") is not None
    )


def _due(conn: Connection, rollouts: list[Any], now: float) -> list[tuple[Any, Any, AttemptStatus]]:
    """(rollout, its latest attempt, the verdict) for each of ``rollouts`` whose live latest attempt is due."""
    latest_ids = [r["latest_attempt_id"] for r in rollouts if r["latest_attempt_id"]]
    attempts = {a["attempt_id"]: a for a in conn.execute(select(A).where(A.c.attempt_id.in_(latest_ids))).mappings()}
    due = []
    for rollout in rollouts:
        attempt = attempts.get(rollout["latest_attempt_id"])
        if attempt is None or attempt["status"] not in (AttemptStatus.PREPARING, AttemptStatus.RUNNING):
            continue
        config = RolloutConfig.model_validate(rollout["config"])
        status = verdict(config, attempt["start_time"], attempt["last_heartbeat_time"], now)
        if status is not None:
            due.append((rollout, attempt, status))
    return due


def sweep(conn: Connection, now: float) -> int:
    """Check every live rollout's latest attempt; return how many attempts changed.

    Read first, lock after: the live rollouts and their attempts are read without locks, and only those found
    due are locked (``SKIP LOCKED``: one a runner is writing is left for the next sweep) and judged again as
    they are then. Locking every live rollout for the sweep's transaction held up every call and span of them
    that came meanwhile (on PostgreSQL), though most have nothing due, or no limits at all."""
    live = R.c.status.in_([s.value for s in ACTIVE])
    rollout_ids = [r.rollout_id for r in conn.execute(select(R.c.rollout_id).where(live).order_by(R.c.pk))]
    changed = 0
    for chunk_start in range(0, len(rollout_ids), 500):
        chunk = rollout_ids[chunk_start : chunk_start + 500]
        # Only rollouts whose config can time out: most live rollouts have no limits (nothing to check).
        read = [r for r in conn.execute(select(R).where(R.c.rollout_id.in_(chunk), live)).mappings()]
        candidates = [r["rollout_id"] for r, _, _ in _due(conn, [r for r in read if _has_limits(r["config"])], now)]
        if not candidates:
            continue
        locked = conn.execute(lock_rows(select(R).where(R.c.rollout_id.in_(candidates), live), conn, skip_locked=True))
        rollouts = list(locked.mappings())
        attempt_ids = [r["latest_attempt_id"] for r in rollouts if r["latest_attempt_id"]]
        conn.execute(lock_rows(select(A.c.pk).where(A.c.attempt_id.in_(attempt_ids)), conn)).all()
        for rollout, attempt, status in _due(conn, rollouts, now):
            apply_attempt_status(conn, rollout, attempt, status, now)
            changed += 1
    return changed
