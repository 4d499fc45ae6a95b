"""Reads: rollouts (filtered, cursor-paginated), attempts, groups, workers and counts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import ColumnElement, Connection, exists, func, select

from rollway.store.db import models
from rollway.store.db.dialect import check_limit, decode_cursor, encode_cursor
from rollway.store.errors import NotFoundError, StoreValidationError
from rollway.store.exports import AGL_ANNOTATION, REWARD_SPAN, reward_value
from rollway.store.schemas import Attempt, Page, Rollout, StoreStats, Worker
from rollway.store.sql import convert
from rollway.store.sql.lifecycle import load_attempt, load_rollout
from rollway.store.states import QUEUED, AttemptStatus, RolloutStatus

R = models.rollouts
A = models.attempts
S = models.spans
W = models.workers


def primary_rewards(conn: Connection, rollout_ids: Sequence[str]) -> dict[str, float]:
    """The primary reward of each rollout that has one: the last one (by sequence id) of its latest attempt."""
    if not rollout_ids:
        return {}
    latest = (R.c.rollout_id == S.c.rollout_id) & (R.c.latest_attempt_id == S.c.attempt_id)
    stmt = (
        select(S.c.rollout_id, S.c.name, S.c.attributes)
        .join(R, latest)
        .where(S.c.rollout_id.in_(list(rollout_ids)), S.c.name.in_([REWARD_SPAN, AGL_ANNOTATION]))
        .order_by(S.c.sequence_id)
    )
    found: dict[str, float] = {}
    for rollout_id, name, attributes in conn.execute(stmt):
        value = reward_value(name, attributes or {})
        if value is not None:
            found[rollout_id] = value
    return found


def list_rollouts(
    conn: Connection,
    *,
    status: Sequence[RolloutStatus] | None = None,
    mode: str | None = None,
    group_id: str | None = None,
    rollout_ids: Sequence[str] | None = None,
    started_after: float | None = None,
    started_before: float | None = None,
    called_model: str | None = None,
    limit: int = 100,
    cursor: str | None = None,
    descending: bool = False,
) -> Page[Rollout]:
    """Rollouts in creation order (newest first when ``descending``), ``limit`` at a time; ``next_cursor``
    continues after the last one, in the same order. The order is the primary key's: unique, so rollouts created
    in the same instant (one enqueue of many tasks) have one order too, and each page starts at the first row
    past the cursor's (``pk >`` it ascending, ``pk <`` it descending), none skipped or repeated; the primary key's
    index answers both directions.
    ``called_model``: only rollouts with a span naming that alias as its ``gen_ai.request.model`` (the gateway
    writes it on every call's span), an ``EXISTS`` the spans' ``(rollout_id, …)`` index answers."""
    check_limit(limit, 10_000)
    after = decode_cursor(cursor)
    stmt = select(R).order_by(R.c.pk.desc() if descending else R.c.pk).limit(limit + 1)
    if called_model is not None:
        named = S.c.attributes["gen_ai.request.model"].as_string() == called_model
        stmt = stmt.where(exists().where(S.c.rollout_id == R.c.rollout_id, named))
    if status:
        try:
            wanted = [RolloutStatus(s).value for s in status]
        except ValueError as exc:
            raise StoreValidationError(f"unknown rollout status in {list(status)}") from exc
        stmt = stmt.where(R.c.status.in_(wanted))
    if mode is not None:
        stmt = stmt.where(R.c.mode == mode)
    if group_id is not None:
        stmt = stmt.where(R.c.group_id == group_id)
    if rollout_ids is not None:
        stmt = stmt.where(R.c.rollout_id.in_(list(rollout_ids)))
    if started_after is not None:
        stmt = stmt.where(R.c.start_time >= started_after)
    if started_before is not None:
        stmt = stmt.where(R.c.start_time < started_before)
    if after is not None:
        stmt = stmt.where(R.c.pk < after if descending else R.c.pk > after)
    rows = (conn.execute(stmt)).mappings().all()
    items = [convert.rollout(r) for r in rows[:limit]]
    next_cursor = encode_cursor(rows[limit - 1]["pk"]) if len(rows) > limit else None
    return Page[Rollout](items=items, next_cursor=next_cursor)


#: Columns ``sorted_rollouts`` orders by.
ROLLOUT_SORT_COLUMNS = ("rollout_id", "start_time", "end_time", "mode", "resources_id", "status")


def sorted_rollouts(
    conn: Connection,
    *,
    status: Sequence[str] | None = None,
    rollout_ids: Sequence[str] | None = None,
    id_contains: str | None = None,
    sort_by: str | None = None,
    descending: bool = False,
    limit: int | None = None,
    offset: int = 0,
) -> tuple[list[Rollout], int]:
    """One page of the rollouts matching every filter given, and how many match in all.

    Ordered by ``sort_by`` (one of ``ROLLOUT_SORT_COLUMNS``) with nulls last (first when descending), ties and
    no ``sort_by`` in creation order; text compares by code point on both engines (whatever the database's
    collation). ``id_contains`` is a case-sensitive substring of the rollout id."""
    where: list[ColumnElement[bool]] = []
    if status is not None:
        try:
            where.append(R.c.status.in_([RolloutStatus(s).value for s in status]))
        except ValueError as exc:
            raise StoreValidationError(f"unknown rollout status in {list(status)}") from exc
    if rollout_ids is not None:
        where.append(R.c.rollout_id.in_(list(rollout_ids)))
    if id_contains is not None:
        position = func.strpos if conn.dialect.name == "postgresql" else func.instr
        where.append(position(R.c.rollout_id, id_contains) > 0)
    stmt = select(R).where(*where)
    if sort_by is not None:
        if sort_by not in ROLLOUT_SORT_COLUMNS:
            raise StoreValidationError(f"cannot sort rollouts by '{sort_by}'")
        column: Any = R.c[sort_by]
        if conn.dialect.name == "postgresql" and sort_by not in ("start_time", "end_time"):
            column = column.collate("C")
        nulls_last = R.c[sort_by].is_(None)
        stmt = stmt.order_by(nulls_last.desc(), column.desc()) if descending else stmt.order_by(nulls_last, column)
    stmt = stmt.order_by(R.c.pk).offset(offset)
    if limit is not None:
        stmt = stmt.limit(limit)
    rows = conn.execute(stmt).mappings().all()
    total = conn.execute(select(func.count()).select_from(R).where(*where)).scalar_one()
    return [convert.rollout(r) for r in rows], int(total)


def get_rollout(conn: Connection, rollout_id: str, *, with_attempts: bool = False) -> Rollout:
    row = load_rollout(conn, rollout_id, lock=False)
    rollout = convert.rollout(row)
    if with_attempts:
        rollout.attempts = list_attempts(conn, rollout_id)
    return rollout


def statuses(conn: Connection, rollout_ids: Sequence[str]) -> dict[str, Any]:
    """``{rollout_id: row}`` for the ids that exist."""
    rows = (conn.execute(select(R).where(R.c.rollout_id.in_(list(rollout_ids))))).mappings().all()
    return {r["rollout_id"]: r for r in rows}


def list_attempts(conn: Connection, rollout_id: str) -> list[Attempt]:
    stmt = select(A).where(A.c.rollout_id == rollout_id).order_by(A.c.sequence_id)
    return [convert.attempt(r) for r in (conn.execute(stmt)).mappings()]


def get_attempt(conn: Connection, rollout_id: str, attempt_id: str) -> Attempt:
    rollout = load_rollout(conn, rollout_id, lock=False)
    return convert.attempt(load_attempt(conn, rollout, attempt_id, lock=False))


def group(conn: Connection, group_id: str) -> list[Rollout]:
    stmt = select(R).where(R.c.group_id == group_id).order_by(R.c.group_index, R.c.pk)
    rows = (conn.execute(stmt)).mappings().all()
    if not rows:
        raise NotFoundError(f"group '{group_id}' not found")
    return [convert.rollout(r) for r in rows]


def list_workers(conn: Connection) -> list[Worker]:
    rows = (conn.execute(select(W).order_by(W.c.worker_id))).mappings()
    return [Worker.model_validate(dict(r)) for r in rows]


def get_worker(conn: Connection, worker_id: str) -> Worker:
    row = (conn.execute(select(W).where(W.c.worker_id == worker_id))).mappings().first()
    if row is None:
        raise NotFoundError(f"worker '{worker_id}' not found")
    return Worker.model_validate(dict(row))


def status_counts(conn: Connection) -> tuple[dict[str, int], dict[str, int]]:
    """(rollouts by status, attempts by status), every status present: two grouped counts, nothing more."""
    rollouts = {r.status: r.n for r in conn.execute(select(R.c.status, func.count().label("n")).group_by(R.c.status))}
    attempts = {r.status: r.n for r in conn.execute(select(A.c.status, func.count().label("n")).group_by(A.c.status))}
    return (
        {s.value: rollouts.get(s.value, 0) for s in RolloutStatus},
        {s.value: attempts.get(s.value, 0) for s in AttemptStatus},
    )


def stats(conn: Connection) -> StoreStats:
    by_status = {r.status: r.n for r in conn.execute(select(R.c.status, func.count().label("n")).group_by(R.c.status))}
    attempts = {r.status: r.n for r in conn.execute(select(A.c.status, func.count().label("n")).group_by(A.c.status))}
    spans = (
        conn.execute(
            select(
                func.count(),
                func.coalesce(func.sum(S.c.input_tokens), 0),
                func.coalesce(func.sum(S.c.output_tokens), 0),
            )
        )
    ).one()
    n_resources = (conn.execute(select(func.count(func.distinct(models.resources.c.resources_id))))).scalar_one()
    n_workers = (conn.execute(select(func.count()).select_from(W))).scalar_one()
    return StoreStats(
        rollouts_by_status={s.value: by_status.get(s.value, 0) for s in RolloutStatus},
        attempts_by_status=attempts,
        queue_depth=sum(by_status.get(s.value, 0) for s in QUEUED),
        total_rollouts=sum(by_status.values()),
        total_attempts=sum(attempts.values()),
        total_spans=int(spans[0]),
        total_resources=int(n_resources),
        total_workers=int(n_workers),
        input_tokens=int(spans[1]),
        output_tokens=int(spans[2]),
    )
