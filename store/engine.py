"""Database engines: SQLite (default, one file, WAL) and PostgreSQL (asyncpg).

SQLite gets two engines over the same file: one connection for the single writer, whose transactions
start with ``BEGIN IMMEDIATE`` so that writers in other processes queue on the file lock instead of failing
mid-transaction, and a small pool of readers (WAL lets them read while the writer writes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import orjson

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import AsyncAdaptedQueuePool

from store.errors import StoreValidationError

SQLITE_BUSY_TIMEOUT_MS = 30_000


def dumps(value: Any) -> str:
    """JSON for the JSON columns: orjson (token id lists are large), stdlib for what orjson refuses."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:  # e.g. integers beyond 64 bits, non-string keys
        return json.dumps(value)


def loads(value: Any) -> Any:
    """orjson.loads; a number passes through (SQLite's NUMERIC affinity gives a scalar JSON number back as one)."""
    if isinstance(value, int | float):
        return value
    return orjson.loads(value)


JSON_CODEC: dict[str, Any] = {"json_serializer": dumps, "json_deserializer": loads}


@dataclass(frozen=True)
class Engines:
    """The engines a store runs on. ``writer is reader`` on PostgreSQL."""

    url: str
    writer: AsyncEngine
    reader: AsyncEngine

    @property
    def is_sqlite(self) -> bool:
        return self.writer.dialect.name == "sqlite"

    async def dispose(self) -> None:
        await self.writer.dispose()
        if self.reader is not self.writer:
            await self.reader.dispose()


def normalize_url(url: str) -> str:
    """Accept plain ``sqlite:///file`` / ``postgresql://`` URLs and pick the async drivers."""
    if "://" not in url:  # a bare path
        url = f"sqlite:///{url}"
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        parsed = parsed.set(drivername="sqlite+aiosqlite")
        if parsed.database in (None, "", ":memory:"):
            raise StoreValidationError(
                "SQLite needs a file: in-memory databases cannot be shared by the writer"
            )
    elif backend in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+asyncpg")
    else:
        raise StoreValidationError(f"unsupported database URL scheme '{parsed.drivername}'")
    return parsed.render_as_string(hide_password=False)


def _sqlite_engine(url: str, *, begin: str, synchronous: str, pool_size: int) -> AsyncEngine:
    engine = create_async_engine(
        url,
        poolclass=AsyncAdaptedQueuePool,
        pool_size=pool_size,
        max_overflow=0,
        connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
        **JSON_CODEC,
    )

    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Let SQLAlchemy, not the sqlite3 module, decide when transactions begin.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA synchronous={synchronous}")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql(begin)

    return engine


def create_engines(url: str, *, sqlite_synchronous: str = "NORMAL", pool_size: int = 10) -> Engines:
    """Build the engines for ``url`` (see module docstring)."""
    url = normalize_url(url)
    if url.startswith("sqlite"):
        if sqlite_synchronous.upper() not in ("OFF", "NORMAL", "FULL", "EXTRA"):
            raise StoreValidationError(f"invalid SQLite synchronous mode '{sqlite_synchronous}'")
        sync = sqlite_synchronous.upper()
        writer = _sqlite_engine(url, begin="BEGIN IMMEDIATE", synchronous=sync, pool_size=1)
        reader = _sqlite_engine(url, begin="BEGIN", synchronous=sync, pool_size=4)
        return Engines(url=url, writer=writer, reader=reader)
    engine = create_async_engine(url, pool_size=pool_size, max_overflow=pool_size, **JSON_CODEC)
    return Engines(url=url, writer=engine, reader=engine)
