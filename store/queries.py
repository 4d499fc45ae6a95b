"""Reads: rollouts (filtered, cursor-paginated), attempts, groups, workers and counts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from store import convert, models
from store.dialect import check_limit, decode_cursor, encode_cursor
from store.errors import NotFoundError
from store.lifecycle import load_attempt, load_rollout
from store.schemas import Attempt, Page, Rollout, StoreStats, Worker
from store.states import FINISHED, QUEUED, RolloutStatus

R = models.rollouts
A = models.attempts
S = models.spans
W = models.workers


async def list_rollouts(
    conn: AsyncConnection,
    *,
    status: Sequence[RolloutStatus] | None = None,
    mode: str | None = None,
    group_id: str | None = None,
    rollout_ids: Sequence[str] | None = None,
    started_after: float | None = None,
    started_before: float | None = None,
    limit: int = 100,
    cursor: str | None = None,
) -> Page[Rollout]:
    """Rollouts in creation order, ``limit`` at a time; ``next_cursor`` continues after the last one."""
    check_limit(limit, 10_000)
    after = decode_cursor(cursor)
    stmt = select(R).order_by(R.c.pk).limit(limit + 1)
    if status:
        stmt = stmt.where(R.c.status.in_([RolloutStatus(s).value for s in status]))
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
        stmt = stmt.where(R.c.pk > after)
    rows = (await conn.execute(stmt)).mappings().all()
    items = [convert.rollout(r) for r in rows[:limit]]
    next_cursor = encode_cursor(rows[limit - 1]["pk"]) if len(rows) > limit else None
    return Page[Rollout](items=items, next_cursor=next_cursor)


async def get_rollout(conn: AsyncConnection, rollout_id: str, *, with_attempts: bool = False) -> Rollout:
    row = await load_rollout(conn, rollout_id, lock=False)
    rollout = convert.rollout(row)
    if with_attempts:
        rollout.attempts = await list_attempts(conn, rollout_id)
    return rollout


async def statuses(conn: AsyncConnection, rollout_ids: Sequence[str]) -> dict[str, Any]:
    """``{rollout_id: row}`` for the ids that exist."""
    rows = (await conn.execute(select(R).where(R.c.rollout_id.in_(list(rollout_ids))))).mappings().all()
    return {r["rollout_id"]: r for r in rows}


async def list_attempts(conn: AsyncConnection, rollout_id: str) -> list[Attempt]:
    stmt = select(A).where(A.c.rollout_id == rollout_id).order_by(A.c.sequence_id)
    return [convert.attempt(r) for r in (await conn.execute(stmt)).mappings()]


async def get_attempt(conn: AsyncConnection, rollout_id: str, attempt_id: str) -> Attempt:
    rollout = await load_rollout(conn, rollout_id, lock=False)
    return convert.attempt(await load_attempt(conn, rollout, attempt_id, lock=False))


async def group(conn: AsyncConnection, group_id: str) -> list[Rollout]:
    stmt = select(R).where(R.c.group_id == group_id).order_by(R.c.group_index, R.c.pk)
    rows = (await conn.execute(stmt)).mappings().all()
    if not rows:
        raise NotFoundError(f"group '{group_id}' not found")
    return [convert.rollout(r) for r in rows]


async def list_workers(conn: AsyncConnection) -> list[Worker]:
    rows = (await conn.execute(select(W).order_by(W.c.worker_id))).mappings()
    return [Worker.model_validate(dict(r)) for r in rows]


async def get_worker(conn: AsyncConnection, worker_id: str) -> Worker:
    row = (await conn.execute(select(W).where(W.c.worker_id == worker_id))).mappings().first()
    if row is None:
        raise NotFoundError(f"worker '{worker_id}' not found")
    return Worker.model_validate(dict(row))


async def stats(conn: AsyncConnection) -> StoreStats:
    by_status = {
        r.status: r.n
        for r in await conn.execute(select(R.c.status, func.count().label("n")).group_by(R.c.status))
    }
    attempts = {
        r.status: r.n
        for r in await conn.execute(select(A.c.status, func.count().label("n")).group_by(A.c.status))
    }
    spans = (
        await conn.execute(
            select(
                func.count(),
                func.coalesce(func.sum(S.c.input_tokens), 0),
                func.coalesce(func.sum(S.c.output_tokens), 0),
            )
        )
    ).one()
    n_resources = (
        await conn.execute(select(func.count(func.distinct(models.resources.c.resources_id))))
    ).scalar_one()
    n_workers = (await conn.execute(select(func.count()).select_from(W))).scalar_one()
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


def is_finished(status: str) -> bool:
    return status in FINISHED
