"""``Store``: the one object callers use, assembled from its parts (``store.parts``: its public methods by area).
It owns the engines, the writer, the background loops (the watchdog's, the WAL checkpoints', the keepalive of
calls in flight) and the in-process signals, opens and closes them, and gives every part the write and read paths
that turn each public method into one read or one write operation."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from sqlalchemy import Connection, text
from sqlalchemy.exc import DBAPIError, IntegrityError

from rollway.store.db import migrate
from rollway.store.db.engine import PG_POOL_SIZE, Engines, create_engines, migration_engine, open_error
from rollway.store.db.faults import FailureLog, WriteHealth, unavailable
from rollway.store.db.pg_writer import PgWriter
from rollway.store.db.writer import BatchWriter, Writer
from rollway.store.errors import ConflictError, UnavailableError
from rollway.store.parts.agents import AgentsMixin
from rollway.store.parts.catalog import CatalogMixin
from rollway.store.parts.controlled import ControlledMixin
from rollway.store.parts.edits import EditsMixin
from rollway.store.parts.keepalive import INTERVAL, CallsInFlight
from rollway.store.parts.lifecycle import LifecycleMixin
from rollway.store.parts.queue import QueueMixin
from rollway.store.parts.reads import ReadsMixin
from rollway.store.parts.spans import SpansMixin
from rollway.store.parts.updates import UpdatesMixin
from rollway.store.parts.wal import WalMixin
from rollway.store.schemas import ApiKey
from rollway.store.signals import Signal
from rollway.store.sql import catalog, watchdog

log = logging.getLogger("rollway.store")

T = TypeVar("T")


class Store(
    QueueMixin,
    LifecycleMixin,
    CatalogMixin,
    UpdatesMixin,
    EditsMixin,
    AgentsMixin,
    ControlledMixin,
    SpansMixin,
    ReadsMixin,
    WalMixin,
):
    """The embedded store over SQLite or PostgreSQL (see the package docstring)."""

    def __init__(
        self,
        engines: Engines,
        writer: Writer,
        *,
        clock: Callable[[], float] = time.time,
        watchdog_interval: float = 1.0,
        poll_interval: float = 0.5,
        keepalive_interval: float = INTERVAL,
        cipher: catalog.Cipher | None = None,
    ) -> None:
        self.engines = engines
        self.writer = writer
        self.clock = clock
        self.cipher = cipher
        self.direct_calls = isinstance(writer, PgWriter)  # PostgreSQL: the call path goes to the driver itself
        self.watchdog_interval = watchdog_interval
        self.poll_interval = poll_interval
        self.finished = Signal()
        self.queued = Signal()
        self._loops: list[asyncio.Task[None]] = []  # the watchdog's, the WAL checkpoints', the calls' keepalive
        self.calls_in_flight = CallsInFlight(self._write, clock, keepalive_interval)
        self.span_observer: Callable[[int], None] | None = None  # told how many spans each add_spans wrote
        self.key_observer: Callable[[ApiKey, str], None] | None = None  # told each rollout key minted
        self.health = WriteHealth(waiting_since=writer.waiting_since)  # whether writes go through (``/readyz``)
        self.failures = FailureLog()  # the database's failures, logged once per kind per interval

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        sqlite_synchronous: str = "NORMAL",
        clock: Callable[[], float] = time.time,
        watchdog_interval: float = 1.0,
        poll_interval: float = 0.5,
        run_watchdog: bool = True,
        max_batch: int = 256,
        keepalive_interval: float = INTERVAL,
        secret_key: str | None = None,
        pg_pool_size: int = PG_POOL_SIZE,
    ) -> Store:
        """Open (and create or upgrade) the database at ``url`` and start the writer, the watchdog and the
        heartbeat of calls in flight (``store.parts.keepalive``; every ``keepalive_interval`` seconds, 0: never). On
        PostgreSQL the process keeps ``pg_pool_size`` connections open.
        A database that cannot be reached or opened is an ``UnavailableError`` saying why.

        With ``secret_key`` (``catalog.Cipher``) the API keys kept for backends and agent servers are stored
        encrypted, and those stored in clear are encrypted now; a database holding encrypted keys opened without
        it, or with a key that does not decrypt them, is a ``StoreValidationError`` saying so."""
        cipher = catalog.Cipher(secret_key) if secret_key else None
        engines = create_engines(url, sqlite_synchronous=sqlite_synchronous, pool_size=pg_pool_size)
        try:
            if engines.pg is not None:
                await migrate.upgrade(engines.pg)
            else:
                upgrader = migration_engine(url)
                try:
                    await migrate.upgrade(upgrader)
                finally:
                    upgrader.dispose()
        except (DBAPIError, OSError) as exc:  # unreachable, no such database or directory, refused: say which
            await engines.dispose()
            raise open_error(url, exc) from exc
        except BaseException:
            await engines.dispose()
            raise
        writer: Writer
        if engines.pg is not None:
            writer = PgWriter(engines.pg)
        else:
            assert engines.writer is not None
            writer = BatchWriter(engines.writer, max_batch=max_batch)
        store = cls(
            engines,
            writer,
            clock=clock,
            watchdog_interval=watchdog_interval,
            poll_interval=poll_interval,
            keepalive_interval=keepalive_interval,
            cipher=cipher,
        )
        await writer.start()
        try:
            await store._write(lambda conn: catalog.seal_stored(conn, cipher))
        except BaseException:
            await store.close()
            raise
        if engines.is_sqlite:
            store._loops.append(asyncio.create_task(store._checkpoint_loop(), name="rollway-checkpoint"))
        if run_watchdog and watchdog_interval > 0:
            store._loops.append(asyncio.create_task(store._watchdog_loop(), name="rollway-watchdog"))
        if keepalive_interval > 0:
            store._loops.append(asyncio.create_task(store.calls_in_flight.run(), name="rollway-calls-keepalive"))
        return store

    async def close(self) -> None:
        for task in self._loops:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._loops.clear()
        await self.writer.close()
        if self.engines.is_sqlite:
            await self.checkpoint()
        await self.engines.dispose()

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    # -- plumbing -------------------------------------------------------------------------------------

    async def _write(self, op: Callable[[Connection], T]) -> T:
        """Every write; the database's failures become ``UnavailableError`` (and make ``health`` say so)."""
        return await self._written(self.writer.submit(op))

    async def _write_direct(self, op: Callable[[Any], Awaitable[T]]) -> T:
        """A write on PostgreSQL's driver connection in no transaction (``PgWriter.submit_direct``), told as
        ``_write`` tells its failures."""
        assert isinstance(self.writer, PgWriter)
        return await self._written(self.writer.submit_direct(op))

    async def _written(self, submitted: Awaitable[T]) -> T:
        try:
            result = await submitted
        except IntegrityError as exc:
            raise ConflictError(f"the write conflicts with stored data: {exc.orig}") from exc
        except sqlite3.IntegrityError as exc:  # from statements run on the driver connection itself
            raise ConflictError(f"the write conflicts with stored data: {exc}") from exc
        except Exception as exc:
            failure = unavailable(exc)
            if failure is None:
                raise
            self.health.failed(failure.message)
            self.failures.log(log, "write", "store write failed: %s", failure.message)
            if failure is exc:
                raise
            raise failure from exc
        self.health.succeeded()
        return result

    async def _read(self, op: Callable[[Connection], T]) -> T:
        try:
            if self.engines.pg is not None:
                async with self.engines.pg.connect() as conn:
                    return await conn.run_sync(op)
            reader = self.engines.reader
            assert reader is not None

            def run() -> T:
                with reader.connect() as conn:
                    return op(conn)

            return await asyncio.to_thread(run)
        except Exception as exc:
            failure = unavailable(exc)
            if failure is None or failure is exc:
                raise
            self.failures.log(log, "read", "store read failed: %s", failure.message)
            raise failure from exc

    async def read(self, op: Callable[[Connection], T]) -> T:
        """Run a read-only function of a SQLAlchemy ``Connection`` (for tools and tests)."""
        return await self._read(op)

    async def ping(self) -> None:
        """Raise when the database cannot be read."""
        await self._read(lambda conn: conn.execute(text("SELECT 1")).scalar_one())

    async def write_problem(self) -> str | None:
        """Why the store cannot write now, or None (``/readyz``): a write failed within the last few seconds with
        none succeeding since, or a write has waited for the database past a bound (``store.db.faults``). Once the
        last failure is older than that and no write succeeded since, one small write is tried: readiness comes
        back when the database does, without waiting for traffic a load balancer no longer sends."""
        problem = self.health.problem()
        if problem is None and self.health.failing():
            try:
                await self._write(lambda conn: watchdog.probe(conn, self.clock()))
            except UnavailableError as exc:
                return exc.message
        return problem

    def _notify_all(self) -> None:
        self.finished.notify()
        self.queued.notify()
