"""The gateway's calls over a recent window, bucketed by time (``GET /admin/v1/stats/series``): calls, errors,
latency, time to first token and tokens per bucket, read from the call spans in the store, so the numbers
cover every replica on the database and survive a restart.

A call span is one the gateway wrote: it carries ``rollway.latency_seconds``. Buckets are by the call's
``start_time``. The spans of the window are found without reading the older ones: rows are written in time
order, so the first primary key of the window is found by a binary search on ``pk`` (each probe one index
look-up), and the aggregate reads from there. The search is only a bound; the ``start_time`` condition still
decides which calls count, and ``SLACK`` seconds of margin cover rows committed slightly out of order.

Every aggregate is computed by the database (``GROUP BY`` the bucket): an hour of a busy gateway is millions of
spans, never loaded here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Integer, case, cast, func, or_, select

from rollway.store.db import models
from rollway.store.exports import REWARD_SPAN

S = models.spans
#: Seconds before the window's start at which the primary-key search aims (rows committed out of order).
SLACK = 60.0


def _number(conn: Connection, key: str) -> Any:
    """The attribute ``key`` of a span as a float where it is a JSON number, else NULL: spans come from clients
    too (``add_spans``, OTLP), and PostgreSQL refuses to cast a text that is not a number."""
    value = S.c.attributes[key].as_float()
    if conn.dialect.name == "postgresql":
        kind = func.json_typeof(S.c.attributes.op("->")(key))
        return case((kind == "number", value), else_=None)
    kind = func.json_type(S.c.attributes, f'$."{key}"')
    return case((kind.in_(("real", "integer")), value), else_=None)


@dataclass(frozen=True, slots=True)
class Bucket:
    index: int
    calls: int
    errors: int
    latency_sum: float
    latency_max: float
    ttft_sum: float
    ttft_count: int
    input_tokens: int
    output_tokens: int


def first_pk_since(conn: Connection, since: float) -> int | None:
    """The smallest primary key of a span written at or after ``since`` (about: see the module docstring);
    None when the table is empty."""
    low, high = conn.execute(select(func.min(S.c.pk), func.max(S.c.pk))).one()
    if high is None:
        return None
    while low < high:
        middle = (low + high) // 2
        row = conn.execute(select(S.c.pk, S.c.created_time).where(S.c.pk >= middle).order_by(S.c.pk).limit(1)).one()
        if row.created_time >= since:
            high = middle
        else:
            low = row.pk + 1
    return int(low)


def reward_buckets(conn: Connection, since: float, step: float) -> dict[int, tuple[int, float]]:
    """The primary rewards recorded at or after ``since`` (``rollway.reward`` spans with a numeric value), per
    ``step`` seconds: bucket index → (rewards, their sum)."""
    first = first_pk_since(conn, since - SLACK)
    if first is None:
        return {}
    value = _number(conn, "rollway.reward.value")
    named = S.c.attributes["rollway.reward.name"].as_string()
    primary = or_(named.is_(None), named == "primary")
    index = cast(func.floor((S.c.start_time - since) / step), Integer).label("bucket")
    stmt = (
        select(index, func.count(value), func.coalesce(func.sum(value), 0.0))
        .where(S.c.pk >= first, S.c.start_time >= since, S.c.name == REWARD_SPAN, value.is_not(None), primary)
        .group_by(index)
    )
    return {int(row[0]): (int(row[1]), float(row[2])) for row in conn.execute(stmt)}


def call_buckets(conn: Connection, since: float, step: float) -> list[Bucket]:
    """The call spans that started at or after ``since``, aggregated per ``step`` seconds (bucket ``index`` 0
    starts at ``since``); buckets without calls are absent."""
    first = first_pk_since(conn, since - SLACK)
    if first is None:
        return []
    latency, ttft = _number(conn, "rollway.latency_seconds"), _number(conn, "rollway.ttft_seconds")
    index = cast(func.floor((S.c.start_time - since) / step), Integer).label("bucket")
    stmt = (
        select(
            index,
            func.count(),
            func.sum(case((S.c.status_code == "ERROR", 1), else_=0)),
            func.coalesce(func.sum(latency), 0.0),
            func.coalesce(func.max(latency), 0.0),
            func.coalesce(func.sum(ttft), 0.0),
            func.count(ttft),
            func.coalesce(func.sum(S.c.input_tokens), 0),
            func.coalesce(func.sum(S.c.output_tokens), 0),
        )
        .where(S.c.pk >= first, S.c.start_time >= since, latency.is_not(None))
        .group_by(index)
        .order_by(index)
    )
    return [
        Bucket(
            index=int(row[0]),
            calls=int(row[1]),
            errors=int(row[2] or 0),
            latency_sum=float(row[3]),
            latency_max=float(row[4]),
            ttft_sum=float(row[5]),
            ttft_count=int(row[6]),
            input_tokens=int(row[7]),
            output_tokens=int(row[8]),
        )
        for row in conn.execute(stmt)
    ]
