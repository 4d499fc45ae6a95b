"""Versioned named resources (LLM endpoints, prompt templates, ...).

Each ``add`` makes a new bundle (new id, version 1); each ``update`` a new immutable version of an existing
bundle (version + 1). The newest version written, of any bundle, is "latest".
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, func, select

from rollway.store import ids
from rollway.store.db import models
from rollway.store.db.dialect import check_limit, decode_cursor, encode_cursor, serialize_key
from rollway.store.errors import NotFoundError, StoreValidationError
from rollway.store.schemas import Page, ResourcesUpdate
from rollway.store.sql import convert

T = models.resources


def _check(resources: Any) -> dict[str, Any]:
    if not isinstance(resources, dict) or not all(isinstance(k, str) and k for k in resources):
        raise StoreValidationError("resources must be an object mapping names to resources")
    return resources


def add(conn: Connection, resources: dict[str, Any], now: float) -> ResourcesUpdate:
    row = {
        "resources_id": ids.resources_id(),
        "version": 1,
        "resources": _check(resources),
        "create_time": now,
        "update_time": now,
    }
    conn.execute(T.insert().values(**row))
    return ResourcesUpdate.model_validate(row)


def update(
    conn: Connection, resources_id: str, resources: dict[str, Any], now: float, *, create: bool = True
) -> ResourcesUpdate:
    """A new version of ``resources_id``. An id that is new makes version 1 with ``create`` (Agent-lightning's
    upsert), else it is a ``NotFoundError`` (the admin API's update: version + 1 of an existing bundle).

    Updates of one bundle take turns (``serialize_key``: PostgreSQL's advisory lock on its id; SQLite's single
    writer already orders them): two at once from two replicas would read the same newest version, and the
    second insert of its successor would be refused as a duplicate."""
    serialize_key(conn, "resources:" + resources_id)
    current = _newest(conn, resources_id)
    if current is None and not create:
        raise NotFoundError(f"resources '{resources_id}' not found")
    row = {
        "resources_id": resources_id,
        "version": 1 if current is None else current.version + 1,
        "resources": _check(resources),
        "create_time": now if current is None else current.create_time,
        "update_time": now,
    }
    conn.execute(T.insert().values(**row))
    return ResourcesUpdate.model_validate(row)


def _newest(conn: Connection, resources_id: str) -> ResourcesUpdate | None:
    stmt = select(T).where(T.c.resources_id == resources_id).order_by(T.c.version.desc()).limit(1)
    row = (conn.execute(stmt)).mappings().first()
    return None if row is None else convert.resources(row)


def get(conn: Connection, resources_id: str) -> ResourcesUpdate:
    found = _newest(conn, resources_id)
    if found is None:
        raise NotFoundError(f"resources '{resources_id}' not found")
    return found


def latest(conn: Connection) -> ResourcesUpdate | None:
    row = (conn.execute(select(T).order_by(T.c.pk.desc()).limit(1))).mappings().first()
    return None if row is None else convert.resources(row)


def latest_id(conn: Connection) -> str | None:
    stmt = select(T.c.resources_id).order_by(T.c.pk.desc()).limit(1)
    return (conn.execute(stmt)).scalar_one_or_none()


def exists(conn: Connection, resources_id: str) -> bool:
    stmt = select(T.c.pk).where(T.c.resources_id == resources_id).limit(1)
    return (conn.execute(stmt)).first() is not None


def many(conn: Connection, resources_ids: set[str]) -> dict[str, ResourcesUpdate]:
    """The newest version of each of ``resources_ids``."""
    if not resources_ids:
        return {}
    newest = (
        select(T.c.resources_id, func.max(T.c.version).label("version"))
        .where(T.c.resources_id.in_(resources_ids))
        .group_by(T.c.resources_id)
        .subquery()
    )
    stmt = select(T).join(newest, (T.c.resources_id == newest.c.resources_id) & (T.c.version == newest.c.version))
    return {row["resources_id"]: convert.resources(row) for row in (conn.execute(stmt)).mappings()}


def page(conn: Connection, limit: int, cursor: str | None) -> Page[ResourcesUpdate]:
    """Every bundle at its newest version, oldest bundle first."""
    check_limit(limit)
    after = decode_cursor(cursor)
    first = select(func.min(T.c.pk).label("pk"), T.c.resources_id).group_by(T.c.resources_id).subquery()
    stmt = select(first.c.pk, first.c.resources_id).order_by(first.c.pk).limit(limit + 1)
    if after is not None:
        stmt = stmt.where(first.c.pk > after)
    rows = (conn.execute(stmt)).all()
    found = many(conn, {r.resources_id for r in rows[:limit]})
    items = [found[r.resources_id] for r in rows[:limit]]
    next_cursor = encode_cursor(rows[limit - 1].pk) if len(rows) > limit else None
    return Page[ResourcesUpdate](items=items, next_cursor=next_cursor)
