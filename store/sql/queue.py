"""The task queue: the atomic claim and direct starts (enqueue is ``store.sql.enqueue``).

The queue is not a separate structure: it is the rollouts in ``queuing``/``requeuing``, ordered by priority
(high first) then by the time they entered the queue (FIFO), read through a partial index. A claim moves
them to ``preparing`` in the same transaction that selects them: on SQLite under the single writer's
``BEGIN IMMEDIATE``, on PostgreSQL with ``FOR UPDATE SKIP LOCKED``, so no rollout goes to two workers.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from sqlalchemy import Connection, Integer, RowMapping, Select, TextClause, bindparam, select, text, update

from rollway.store import ids
from rollway.store.db import models
from rollway.store.db.dialect import lock_rows, prebuilt, serialize_key, upsert
from rollway.store.errors import ConflictError, StoreValidationError
from rollway.store.schemas import AttemptedRollout, ClaimFilter, TaskSpec
from rollway.store.sql import convert, enqueue, groups, matching, replays
from rollway.store.sql import resources as resources_ops
from rollway.store.sql.enqueue import as_mapping
from rollway.store.sql.lifecycle import load_rollout, set_rollout_status, sync_worker
from rollway.store.states import AttemptStatus, RolloutStatus

R = models.rollouts
A = models.attempts


def _new_attempt(
    conn: Connection,
    rollout: RowMapping,
    worker_id: str | None,
    now: float,
    attempt_id: str | None = None,
    request: str | None = None,
) -> dict[str, Any]:
    attempt = {
        "rollout_id": rollout["rollout_id"],
        "attempt_id": attempt_id or ids.attempt_id(),
        "sequence_id": rollout["attempt_count"] + 1,
        "status": AttemptStatus.PREPARING.value,
        "worker_id": worker_id,
        "start_time": now,
        "end_time": None,
        "last_heartbeat_time": None,
        "metadata": None,
        "request_digest": request,
    }
    if attempt_id is None:
        ids.redraw_taken(conn, A.c.attempt_id, [attempt], ids.attempt_id)
    set_rollout_status(conn, rollout, RolloutStatus.PREPARING, now)  # refuses finished rollouts
    conn.execute(A.insert().values(**attempt))
    conn.execute(
        update(R)
        .where(R.c.pk == rollout["pk"])
        .values(attempt_count=attempt["sequence_id"], latest_attempt_id=attempt["attempt_id"])
    )
    sync_worker(conn, worker_id, rollout["rollout_id"], attempt["attempt_id"], AttemptStatus.PREPARING, now)
    return attempt


def _attempted(conn: Connection, pairs: list[tuple[RowMapping, dict[str, Any]]], now: float) -> list[AttemptedRollout]:
    wanted = {r["resources_id"] for r, _ in pairs if r["resources_id"]}
    found = resources_ops.many(conn, wanted)
    out = []
    for rollout, attempt in pairs:
        ro = convert.rollout(rollout).model_copy(
            update={
                "status": RolloutStatus.PREPARING,
                "attempt_count": attempt["sequence_id"],
                "end_time": None,
            }
        )
        out.append(
            AttemptedRollout(
                rollout=ro,
                attempt=convert.attempt(as_mapping(attempt)),
                resources=found.get(rollout["resources_id"]) if rollout["resources_id"] else None,
            )
        )
    return out


def _filtered_head(conn: Connection, where: ClaimFilter) -> tuple[Select[Any] | TextClause, dict[str, Any]]:
    """The runners' queue head of rollouts ``where`` admits, and the parameters its filter adds (built for each
    claim that filters; the filter's terms narrow the same index scan)."""
    metadata = matching.checked(where.metadata)
    params: dict[str, Any] = {}
    if conn.dialect.name == "sqlite":
        extra = ""
        if where.mode is not None:
            extra, params["f_mode"] = extra + " AND mode = :f_mode", where.mode
        if where.group_id is not None:
            extra, params["f_group"] = extra + " AND group_id = :f_group", where.group_id
        terms, values = matching.sqlite_terms(metadata, "f_")
        sql = _sqlite_head(conn, models.RUNNER_QUEUE_SQL + extra + terms, "ix_rollouts_queue")
        return text(sql).columns(*R.c), {**params, **values}  # type: ignore[return-value]
    stmt = select(R).where(text(models.RUNNER_QUEUE_SQL))
    if where.mode is not None:
        stmt = stmt.where(R.c.mode == where.mode)
    if where.group_id is not None:
        stmt = stmt.where(R.c.group_id == where.group_id)
    stmt = stmt.where(*matching.clauses(conn.dialect.name, R.c.metadata, metadata))
    stmt = stmt.order_by(R.c.priority.desc(), R.c.queue_time, R.c.pk)
    return lock_rows(stmt.limit(bindparam("limit", type_=Integer)), conn, skip_locked=True), params


def _build_queue_head(conn: Connection, agent: bool) -> Select[Any] | TextClause:
    """The first ``:limit`` queued rollouts in claim order: the runners' queue (tasks for no agent server),
    read through the partial index ``ix_rollouts_queue``, or the queue of agent server ``:agent``, through
    ``ix_rollouts_agent_queue``.

    The queue predicate is spelled out literally: with bound values (``status IN (?, ?)``) neither engine can
    prove the partial index applies. SQLite is also told to use it: without statistics its planner prefers
    ``ix_rollouts_status`` and sorts every queued row, which makes each claim O(queue depth).
    """
    where = f"{models.AGENT_QUEUE_SQL} AND agent = :agent" if agent else models.RUNNER_QUEUE_SQL
    index = "ix_rollouts_agent_queue" if agent else "ix_rollouts_queue"
    if conn.dialect.name == "sqlite":
        return text(_sqlite_head(conn, where, index)).columns(*R.c)  # type: ignore[return-value]
    stmt = select(R).where(text(where)).order_by(R.c.priority.desc(), R.c.queue_time, R.c.pk)
    return lock_rows(stmt.limit(bindparam("limit", type_=Integer)), conn, skip_locked=True)


def _sqlite_head(conn: Connection, where: str, index: str) -> str:
    quote = conn.dialect.identifier_preparer.quote
    columns = ", ".join(quote(c.name) for c in R.c)
    return (
        f"SELECT {columns} FROM rollouts INDEXED BY {index} WHERE {where} "
        "ORDER BY priority DESC, queue_time, pk LIMIT :limit"
    )


def _build_claimed(conn: Connection) -> Any:
    """A claimed rollout: ``preparing`` with its new attempt."""
    return (
        update(R)
        .where(R.c.pk == bindparam("b_pk"))
        .values(
            status=RolloutStatus.PREPARING.value,
            attempt_count=bindparam("b_count"),
            latest_attempt_id=bindparam("b_attempt"),
            queue_time=None,
            updated_time=bindparam("b_now"),
        )
    )


def _build_worker(conn: Connection, busy: bool) -> Any:
    """The claiming worker's row. Empty-handed: its dequeue time (a new worker starts ``idle``). With work:
    also what ``sync_worker`` does for ``preparing`` (busy, current ids)."""
    names = ["last_dequeue_time", "status", "last_busy_time", "current_rollout_id", "current_attempt_id"]
    values: dict[str, Any] = {name: bindparam(f"w_{name}") for name in (names if busy else names[:2])}
    changed = values if busy else {"last_dequeue_time": values["last_dequeue_time"]}
    return (
        upsert(conn, models.workers)
        .values(worker_id=bindparam("w_worker_id"), **values)
        .on_conflict_do_update(index_elements=["worker_id"], set_=changed)
    )


def claim(
    conn: Connection,
    worker_id: str | None,
    limit: int,
    now: float,
    *,
    agent: str | None = None,
    key: str | None = None,
    where: ClaimFilter | None = None,
) -> list[AttemptedRollout]:
    """Hand up to ``limit`` queued rollouts to ``worker_id``, each with a new attempt in ``preparing``; with
    ``where``, only rollouts it admits (a runner's claim: mode, group, metadata).

    Runners (``agent`` None) only get tasks for no agent server; a remote agent server's dispatcher only the
    tasks enqueued with ``agent: <its name>`` (``store.sql.agents.claim``). With an idempotency ``key``, the
    attempts' ids derive from it, and a claim sent again with it (a retry after a lost answer) gets what the
    first one handed out instead of more rollouts (which nobody would run)."""
    if key is not None:
        serialize_key(conn, key)
        if earlier := replays.claimed_before(conn, key, worker_id, limit):
            return earlier
    request = None if key is None else replays.claim_digest(worker_id)
    params: dict[str, Any] = {"limit": limit} if agent is None else {"limit": limit, "agent": agent}
    if where is not None and not where.empty and agent is None:
        head, narrowed = _filtered_head(conn, where)
        params |= narrowed
    else:
        name = "queue_head" if agent is None else "agent_queue_head"
        head = prebuilt(conn, name, partial(_build_queue_head, agent=agent is not None))
    rows = (conn.execute(head, params)).mappings().all()
    if not rows:
        if worker_id:
            idle = {"w_worker_id": worker_id, "w_last_dequeue_time": now, "w_status": "idle"}
            conn.execute(prebuilt(conn, "worker_idle", partial(_build_worker, busy=False)), idle)
        return []
    attempts = [
        {
            "rollout_id": r["rollout_id"],
            "attempt_id": ids.attempt_id() if key is None else ids.derived("at-", key, i),
            "sequence_id": r["attempt_count"] + 1,
            "status": AttemptStatus.PREPARING.value,
            "worker_id": worker_id,
            "start_time": now,
            "end_time": None,
            "last_heartbeat_time": None,
            "metadata": None,
            "request_digest": request,
        }
        for i, r in enumerate(rows)
    ]
    if key is None:
        ids.redraw_taken(conn, A.c.attempt_id, attempts, ids.attempt_id)
    conn.execute(A.insert(), attempts)
    conn.execute(
        prebuilt(conn, "claimed", _build_claimed),
        [
            {"b_pk": r["pk"], "b_count": a["sequence_id"], "b_attempt": a["attempt_id"], "b_now": now}
            for r, a in zip(rows, attempts, strict=True)
        ],
    )
    if worker_id:
        last = attempts[-1]
        busy = {
            "w_worker_id": worker_id,
            "w_last_dequeue_time": now,
            "w_status": "busy",
            "w_last_busy_time": now,
            "w_current_rollout_id": last["rollout_id"],
            "w_current_attempt_id": last["attempt_id"],
        }
        conn.execute(prebuilt(conn, "worker_busy", partial(_build_worker, busy=True)), busy)
    return _attempted(conn, list(zip(rows, attempts, strict=True)), now)


def start_rollout(
    conn: Connection, spec: TaskSpec, worker_id: str | None, now: float, key: str | None = None
) -> AttemptedRollout:
    """Create a rollout that skips the queue: attempt 1 in ``preparing`` right away. With an idempotency
    ``key`` (and no client ``rollout_id``), the rollout's id derives from it, and the same call again gets the
    rollout and attempt the first one made, as they are now.

    It makes one rollout: with a ``group_id``, it joins that group, and a ``group_size`` declares the group's
    size (``store.sql.groups``: the group is complete once that many members finished)."""
    if (spec.group_size or 1) != 1 and not spec.group_id:
        raise StoreValidationError(
            "a direct start makes one rollout: group_size is the size of the group it joins, and needs a group_id"
        )
    latest = enqueue.resources_for(conn, [spec])
    group = (spec.group_id, 0 if spec.group_id else None)
    rollout_id = spec.rollout_id or (None if key is None else ids.derived("ro-", key, 0))
    # group_size 1 is a start's default (one rollout): it joins the group as it is, as before sizes were declared.
    size = spec.group_size or 1
    declared = {spec.group_id: size} if spec.group_id and size > 1 else {}
    if key is not None:
        serialize_key(conn, key)
    row = enqueue.rollout_row(spec, rollout_id or ids.rollout_id(), group, RolloutStatus.PREPARING, latest, now)
    if rollout_id is None:
        ids.redraw_taken(conn, R.c.rollout_id, [row], ids.rollout_id)
    if key is not None:
        row["request_digest"] = replays.start_digest(spec, worker_id)
    if rollout_id:
        taken = conn.execute(select(R).where(R.c.rollout_id == rollout_id)).mappings().first()
        if taken is not None and spec.rollout_id is None:  # sent again: its group was joined the first time
            if not groups.keeps_sizes([taken], declared):
                raise replays.other_request(key or "")
            return replays.started_before(conn, key or "", taken, row, spec, worker_id)
        if taken is not None:
            raise ConflictError(f"rollout '{spec.rollout_id}' already exists")
    if spec.group_id:
        groups.join(conn, [spec.group_id], [row], declared)
    row["pk"] = (conn.execute(R.insert().values(**row).returning(R.c.pk))).scalar_one()
    rollout = as_mapping(row)
    attempt = _new_attempt(conn, rollout, worker_id, now)
    return (_attempted(conn, [(rollout, attempt)], now))[0]


def start_attempt(
    conn: Connection, rollout_id: str, worker_id: str | None, now: float, key: str | None = None
) -> AttemptedRollout:
    """A new attempt for an existing rollout (a manual retry); the previous attempt becomes stale. With an
    idempotency ``key`` the attempt's id derives from it, and the same call again gets that attempt instead of
    starting another (which would make the one the first call started stale)."""
    attempt_id = request = None
    if key is not None:
        serialize_key(conn, key)
        attempt_id = ids.derived("at-", key, -1)  # -1: not a claim's position
        if (earlier := replays.attempt_started_before(conn, key, attempt_id, rollout_id, worker_id)) is not None:
            return earlier
        request = replays.attempt_digest(rollout_id, worker_id)
    rollout = load_rollout(conn, rollout_id)
    attempt = _new_attempt(conn, rollout, worker_id, now, attempt_id, request)
    return (_attempted(conn, [(rollout, attempt)], now))[0]
