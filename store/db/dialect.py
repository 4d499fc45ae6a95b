"""The few places where SQLite and PostgreSQL differ in SQL, behind one small interface."""

from __future__ import annotations

import base64
import binascii
import sqlite3
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection, Select, Table, text
from sqlalchemy.dialects import postgresql, sqlite

from rollway.store.errors import StoreValidationError


def upsert(conn: Connection, table: Table) -> Any:
    """An ``INSERT`` with ``on_conflict_do_*`` (both engines spell it the same way)."""
    if conn.dialect.name == "postgresql":
        return postgresql.insert(table)
    return sqlite.insert(table)


def sqlite_driver(conn: Connection) -> sqlite3.Connection | None:
    """The ``sqlite3`` connection under ``conn`` on SQLite, else None. Hot paths run their statements on it
    directly: SQLAlchemy's per-statement work costs more than SQLite's."""
    if conn.dialect.name != "sqlite":
        return None
    raw: sqlite3.Connection = conn.connection.driver_connection  # type: ignore[assignment]
    return raw


def serialize_key(conn: Connection, key: str) -> None:
    """Make transactions that carry the same client idempotency ``key`` run one after the other, so a retry
    that overlaps its first try sees what that try did. PostgreSQL: a transaction-scoped advisory lock on the
    key's hash (replicas included); SQLite's single writer already runs transactions one at a time."""
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock(hashtextextended(:key, 0))"), {"key": "rollway:" + key})


_PREBUILT: dict[tuple[str, str], Any] = {}


def prebuilt(conn: Connection, name: str, build: Callable[[Connection], Any]) -> Any:
    """A statement built once per dialect (values as ``bindparam``s): on hot paths, building a statement and
    its cache key costs more than running it."""
    key = (conn.dialect.name, name)
    stmt = _PREBUILT.get(key)
    if stmt is None:
        stmt = _PREBUILT[key] = build(conn)
    return stmt


def lock_rows(stmt: Select[Any], conn: Connection, *, skip_locked: bool = False) -> Select[Any]:
    """``FOR UPDATE [SKIP LOCKED]`` on PostgreSQL; SQLite's single writer already excludes other writers."""
    if conn.dialect.name == "postgresql":
        return stmt.with_for_update(skip_locked=skip_locked)
    return stmt


#: The largest pk a cursor may name (the paginated tables' pk columns are INTEGER on PostgreSQL).
MAX_CURSOR_PK = 2**31 - 1


def encode_cursor(pk: int) -> str:
    return base64.urlsafe_b64encode(f"pk:{pk}".encode()).decode().rstrip("=")


def decode_cursor(cursor: str | None) -> int | None:
    """The row position a cursor stands for; a cursor this store did not make is a validation error."""
    if cursor is None or cursor == "":
        return None
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        kind, _, value = raw.partition(":")
        if kind != "pk":
            raise ValueError(kind)
        pk = int(value)
    except (ValueError, UnicodeDecodeError, binascii.Error) as exc:
        raise StoreValidationError(f"invalid cursor '{cursor}'") from exc
    if pk < 0 or pk > MAX_CURSOR_PK:  # beyond the 32-bit pk columns: a forged cursor, not a DB error
        raise StoreValidationError(f"invalid cursor '{cursor}'")
    return pk


def check_limit(limit: int, maximum: int = 1000) -> int:
    if limit < 1 or limit > maximum:
        raise StoreValidationError(f"limit must be between 1 and {maximum}, got {limit}")
    return limit
