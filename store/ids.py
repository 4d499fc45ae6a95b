"""Identifiers the store hands out, in Agent-lightning's shapes (``ro-`` + 12 hex, ...); attempt ids get
12 hex digits rather than Agent-lightning's 8, so that they stay unique across the whole store."""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sqlalchemy import Column, Connection


def rollout_id() -> str:
    return "ro-" + secrets.token_hex(6)


def attempt_id() -> str:
    return "at-" + secrets.token_hex(6)  # 48 bits: ids are unique across the whole store


def resources_id() -> str:
    return "rs-" + secrets.token_hex(6)


def group_id() -> str:
    return "gr-" + secrets.token_hex(6)


def key_id() -> str:
    return "key-" + secrets.token_hex(6)


def update_id() -> str:
    return "wu-" + secrets.token_hex(8)


def backend_id() -> str:
    return "be-" + secrets.token_hex(4)


def trace_id() -> str:
    return secrets.token_hex(16)


def span_id() -> str:
    return secrets.token_hex(8)


def derived(prefix: str, key: str, *parts: int) -> str:
    """An id of the usual shape made from a client's idempotency key (and positions in its request): the same
    key and positions give the same id, so a retried request finds what the first one made."""
    seed = "\x00".join([prefix, key, *map(str, parts)]).encode()
    return prefix + hashlib.sha256(seed).hexdigest()[:12]


def derived_hex(key: str, *parts: int | str, digits: int = 16) -> str:
    """A span id (16 hex digits) or trace id (32) made from a client's idempotency key and positions in its
    request, like ``derived``."""
    seed = "\x00".join(["hex", key, *map(str, parts)]).encode()
    return hashlib.sha256(seed).hexdigest()[:digits]


def redraw_taken(conn: Connection, column: Column[Any], rows: list[dict[str, Any]], make: Callable[[], str]) -> None:
    """Draw again the random ids of ``rows`` (under ``column``'s name) that ``column`` holds already.

    Random ids have 48 bits (Agent-lightning's shape): among the millions of rollouts and attempts a long
    training run makes, one may come up twice, and a rollout whose id another already has would be refused (or,
    next to tasks with their own ids, answered with that other rollout). On SQLite the check is one statement
    on the driver with the ids as one JSON parameter (a claim makes it: SQLAlchemy's own work per statement
    would cost more than the claim's)."""
    from sqlalchemy import select  # here, not at the top: the schemas use this module's ids without SQLAlchemy

    from rollway.store.db.dialect import sqlite_driver

    field = column.name
    raw = sqlite_driver(conn)
    if raw is not None and len(rows) == 1:  # a claim's or a start's one id: the common case
        one = f"SELECT 1 FROM {column.table.name} WHERE {field} = ?"
        while raw.execute(one, (rows[0][field],)).fetchone() is not None:
            rows[0][field] = make()
        return
    many = f"SELECT {field} FROM {column.table.name} WHERE {field} IN (SELECT value FROM json_each(?))"
    while rows:
        wanted = [row[field] for row in rows]
        taken: set[str] = set()
        for start in range(0, len(wanted), _CHECKED_AT_ONCE):
            chunk = wanted[start : start + _CHECKED_AT_ONCE]
            if raw is not None:
                taken.update(found for (found,) in raw.execute(many, (json.dumps(chunk),)))
            else:
                taken.update(conn.execute(select(column).where(column.in_(chunk))).scalars())
        rows = [row for row in rows if row[field] in taken]
        for row in rows:
            row[field] = make()


_CHECKED_AT_ONCE = 5000  # ids per query (bound parameters)
