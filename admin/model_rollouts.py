"""Rollouts that called a model alias (``GET /admin/v1/rollouts?model=<alias>``): the store's rollout listing
(creation order, the same filters, the same cursor) with one more condition, that a span of the rollout names
the alias as its ``gen_ai.request.model`` (the gateway writes it on every call's span).

The condition is an ``EXISTS`` over the rollout's spans, which the spans' ``(rollout_id, attempt_id,
sequence_id)`` index finds; a page of ``limit`` rollouts reads the spans of the rollouts it looks at, and stops
once it has ``limit`` + 1 of them.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Connection, exists, select

from rollway.store import Page, Rollout, RolloutStatus, convert, models
from rollway.store.dialect import check_limit, decode_cursor, encode_cursor

R = models.rollouts
S = models.spans


def rollouts_calling(
    conn: Connection,
    model: str,
    *,
    status: Sequence[RolloutStatus] | None = None,
    mode: str | None = None,
    group_id: str | None = None,
    started_after: float | None = None,
    started_before: float | None = None,
    limit: int = 100,
    cursor: str | None = None,
) -> Page[Rollout]:
    check_limit(limit, 1000)
    after = decode_cursor(cursor)
    called = exists().where(
        S.c.rollout_id == R.c.rollout_id, S.c.attributes["gen_ai.request.model"].as_string() == model
    )
    stmt = select(R).where(called).order_by(R.c.pk).limit(limit + 1)
    if status:
        stmt = stmt.where(R.c.status.in_([RolloutStatus(s).value for s in status]))
    if mode is not None:
        stmt = stmt.where(R.c.mode == mode)
    if group_id is not None:
        stmt = stmt.where(R.c.group_id == group_id)
    if started_after is not None:
        stmt = stmt.where(R.c.start_time >= started_after)
    if started_before is not None:
        stmt = stmt.where(R.c.start_time < started_before)
    if after is not None:
        stmt = stmt.where(R.c.pk > after)
    rows = conn.execute(stmt).mappings().all()
    items = [convert.rollout(r) for r in rows[:limit]]
    return Page[Rollout](items=items, next_cursor=encode_cursor(rows[limit - 1]["pk"]) if len(rows) > limit else None)
