"""Database engines: SQLite (default, one file, WAL) and PostgreSQL (asyncpg).

Store operations are plain functions over a SQLAlchemy ``Connection``; how they reach the database depends on
the engine (see ``store.db.writer``):

- SQLite: synchronous ``sqlite3`` connections. One is the writer's, used from the event loop itself (a write
  transaction takes tens of microseconds; per-statement thread hops would cost more than the work). Its
  ``busy_timeout`` is 0, so a lock held by another process never blocks the loop: the writer backs off and
  retries asynchronously. A small pool of reader connections serves reads in worker threads (WAL lets them
  read while the writer writes). Automatic checkpoints are off on the writer; ``checkpoint()`` runs them in
  a thread instead, so a checkpoint's fsync never stalls the loop.
- PostgreSQL: an async engine (asyncpg) with a pool of ``PG_POOL_SIZE`` connections; operations run through
  ``AsyncConnection.run_sync``, the call path's two writes on the driver itself (``store.sql.pg_calls``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import QueuePool, StaticPool

from rollway.store.errors import StoreValidationError, UnavailableError

SQLITE_BUSY_TIMEOUT_MS = 30_000
#: PostgreSQL connections a process keeps open (each ``rollway serve`` process, each of its workers).
PG_POOL_SIZE = 20
#: A write-ahead log longer than this is emptied at the next checkpoint (``Store.checkpoint``).
WAL_RESET_BYTES = 128 * 1024 * 1024
WAL_RESET_WAIT_MS = 100


def dumps(value: Any) -> str:
    """JSON for the JSON columns: orjson (token id lists are large), stdlib for what orjson refuses."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:  # e.g. integers beyond 64 bits, non-string keys
        return json.dumps(value)


def loads(value: Any) -> Any:
    """Read a JSON column. SQLite's column affinity hands back a bare JSON number already converted."""
    if isinstance(value, int | float):
        return value
    return orjson.loads(value)


JSON_CODEC: dict[str, Any] = {"json_serializer": dumps, "json_deserializer": loads}


@dataclass(frozen=True)
class Engines:
    """SQLite: ``writer`` (one connection, loop thread) and ``reader`` (pool, worker threads) sync engines.
    PostgreSQL: ``pg`` (async)."""

    url: str
    writer: Engine | None = None
    reader: Engine | None = None
    pg: AsyncEngine | None = None

    @property
    def is_sqlite(self) -> bool:
        return self.pg is None

    @property
    def primary(self) -> Engine | AsyncEngine:
        """An engine to read with outside the store (tools, tests): PostgreSQL's, or SQLite's readers."""
        engine = self.pg if self.pg is not None else self.reader
        assert engine is not None
        return engine

    async def dispose(self) -> None:
        if self.writer is not None:
            self.writer.dispose()
        if self.reader is not None:
            self.reader.dispose()
        if self.pg is not None:
            await self.pg.dispose()


def normalize_url(url: str) -> str:
    """Accept plain ``sqlite:///file`` / ``postgresql://`` URLs (or a bare path) and pick the drivers."""
    if "://" not in url:  # a bare path
        url = f"sqlite:///{url}"
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        parsed = parsed.set(drivername="sqlite+pysqlite")
        if parsed.database in (None, "", ":memory:"):
            raise StoreValidationError("SQLite needs a file: in-memory databases cannot be shared by the writer")
    elif backend in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+asyncpg")
    else:
        raise StoreValidationError(f"unsupported database URL scheme '{parsed.drivername}'")
    return parsed.render_as_string(hide_password=False)


def open_error(url: str, exc: BaseException) -> UnavailableError:
    """Why the database at ``url`` could not be opened, in words a person can act on: the driver's own message
    (not SQLAlchemy's wrapper and its traceback), the URL without its password, and for a SQLite file in a
    directory that does not exist, that (SQLite itself only says "unable to open database file")."""
    reason = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    parsed = make_url(normalize_url(url))
    hint = ""
    if parsed.get_backend_name() == "sqlite" and parsed.database:
        folder = Path(parsed.database).parent
        if not folder.is_dir():
            hint = f" (the directory {folder} does not exist: create it, or give another path)"
        elif Path(parsed.database).is_dir():
            hint = (
                f" ({parsed.database} is a directory: give a file in it, e.g. {Path(parsed.database) / 'rollway.db'})"
            )
    shown = parsed.set(drivername=parsed.get_backend_name()).render_as_string(hide_password=True)
    return UnavailableError(f"cannot open the database {shown}: {str(reason).strip() or type(reason).__name__}{hint}")


#: Tries of ``PRAGMA journal_mode=WAL`` on a file another process is creating or migrating, a little longer apart
#: each time (about 8 s in all).
WAL_TRIES = 40


def _wal(cursor: Any) -> None:
    """Put the connection in WAL mode. While another process holds the file's lock to create or migrate it, SQLite
    can refuse the mode change at once (``database is locked``) without waiting out the busy timeout: several
    servers started on one new file at once, so it is asked again a moment later."""
    for attempt in range(WAL_TRIES):
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or attempt == WAL_TRIES - 1:
                raise
            time.sleep(0.01 * (attempt + 1))  # (only at a connection's set-up, and only while contended)


def _sqlite_engine(url: str, *, begin: str, synchronous: str, busy_ms: int, writer: bool) -> Engine:
    engine = create_engine(
        url,
        poolclass=StaticPool if writer else QueuePool,
        connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000, "isolation_level": None},
        **({} if writer else {"pool_size": 4, "max_overflow": 4}),
        **JSON_CODEC,
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        # Spans are large rows (token id lists): 16 KiB pages keep most of them out of overflow chains.
        # Only takes effect when the file is created (before WAL mode is set).
        cursor.execute("PRAGMA page_size=16384")
        _wal(cursor)
        cursor.execute(f"PRAGMA synchronous={synchronous}")
        cursor.execute("PRAGMA foreign_keys=ON")
        if writer:
            cursor.execute("PRAGMA wal_autocheckpoint=0")
            cursor.execute("PRAGMA journal_size_limit=67108864")
        cursor.execute(f"PRAGMA busy_timeout={busy_ms}")
        cursor.close()

    if begin:  # the writer drives BEGIN/COMMIT on the sqlite3 connection itself (store.db.writer)

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Any) -> None:
            conn.exec_driver_sql(begin)

    return engine


def migration_engine(url: str) -> Engine:
    """A short-lived SQLite engine for schema upgrades: ``BEGIN IMMEDIATE`` and a busy timeout, so processes
    opening one new file at the same time migrate it one after the other."""
    return _sqlite_engine(
        normalize_url(url), begin="BEGIN IMMEDIATE", synchronous="NORMAL", busy_ms=SQLITE_BUSY_TIMEOUT_MS, writer=False
    )


def _create_private(path: str | None) -> None:
    """Create a new SQLite file readable by its owner only (0600; SQLite gives its ``-wal`` and ``-shm`` files
    the same mode): it holds the backends' API keys. An existing file is left as it is; a path that cannot be
    created is left for SQLite to report (``Store.open`` says why)."""
    if not path or path == ":memory:" or path.startswith("file:"):
        return
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError:
        return


def create_engines(url: str, *, sqlite_synchronous: str = "NORMAL", pool_size: int = PG_POOL_SIZE) -> Engines:
    """Build the engines for ``url`` (see module docstring)."""
    url = normalize_url(url)
    if url.startswith("sqlite"):
        sync = sqlite_synchronous.upper()
        if sync not in ("OFF", "NORMAL", "FULL", "EXTRA"):
            raise StoreValidationError(f"invalid SQLite synchronous mode '{sqlite_synchronous}'")
        _create_private(make_url(url).database)
        writer = _sqlite_engine(url, begin="", synchronous=sync, busy_ms=0, writer=True)
        reader = _sqlite_engine(url, begin="BEGIN", synchronous=sync, busy_ms=SQLITE_BUSY_TIMEOUT_MS, writer=False)
        return Engines(url=url, writer=writer, reader=reader)
    # No overflow: a connection beyond the pool would be closed as soon as it is given back, and under load
    # (more writes in flight than connections) every call would open one, a server process forked and the
    # driver's set-up run for each: three times the CPU per call, measured. Writes beyond the pool wait for a
    # connection instead.
    engine = create_async_engine(url, pool_size=pool_size, max_overflow=0, **JSON_CODEC)
    return Engines(url=url, pg=engine)


@dataclass
class WalKeeper:
    """Checkpoints of one SQLite file (``Store.checkpoint``), each run in a worker thread on a pooled reader
    connection outside any transaction: ``passive`` copies the log each time and says whether it is due to be
    emptied (past ``WAL_RESET_BYTES``); ``truncate`` empties it, holding the write lock while it waits for
    readers (at most ``WAL_RESET_WAIT_MS``). When a reader stays (a long export, a shell on the file) it gives
    up and is not due again for a while (1 s, doubling up to a minute), so such a reader cannot keep writes
    waiting round after round.

    Why both: a passive checkpoint copies the log but never starts it over. SQLite restarts the log from its
    beginning only when a write begins with every frame copied and no reader in the log, which commits made
    while the copy ran (steady load) prevent every time: the file then grew by every write (16 GB in 5 minutes
    at 280 calls/s). ``truncate`` runs with the process's writer paused (writes wait, the loop does not), so
    that it does not race that writer for the lock."""

    reader: Engine
    not_before: float = 0.0  # monotonic time before which the log is not due to be emptied
    backoff: float = 0.0

    def passive(self) -> bool:
        with self._cursor() as cursor:
            _, frames, _ = cursor.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            large = frames * cursor.execute("PRAGMA page_size").fetchone()[0] > WAL_RESET_BYTES
        return bool(large) and time.monotonic() >= self.not_before

    def truncate(self) -> None:
        with self._cursor() as cursor:
            cursor.execute(f"PRAGMA busy_timeout={WAL_RESET_WAIT_MS}")
            try:
                busy, frames, _ = cursor.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            finally:
                cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        self.backoff = min(max(self.backoff * 2, 1.0), 60.0) if busy else 0.0
        self.not_before = time.monotonic() + self.backoff
        if busy:
            logging.getLogger("rollway.store").warning(
                "the write-ahead log (%d frames) could not be emptied: a reader stayed; next try in %.0f s",
                frames,
                self.backoff,
            )

    @contextlib.contextmanager
    def _cursor(self) -> Iterator[Any]:
        raw = self.reader.raw_connection()
        try:
            cursor = raw.cursor()
            yield cursor
            cursor.close()
        finally:
            raw.close()
