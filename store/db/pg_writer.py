"""The PostgreSQL write path (``store.db.writer`` describes both engines'): ``PgWriter`` runs each operation in
its own transaction from the pool (``run_sync`` over asyncpg) and retries it on deadlock or serialization failure;
row locks (``FOR UPDATE [SKIP LOCKED]``) do the rest. A write goes on when its caller stops waiting."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from rollway.store.db.faults import unavailable
from rollway.store.db.writer import Operation, WriteStats
from rollway.store.errors import ConflictError, StoreValidationError

log = logging.getLogger("rollway.store")

T = TypeVar("T")

RETRYABLE_PG_CODES = frozenset({"40001", "40P01"})  # serialization_failure, deadlock_detected
#: SQLSTATE class of the values a column cannot hold (a text too long, an integer out of range, ...).
PG_DATA_EXCEPTION = "22"
#: SQLSTATE class of integrity constraint violations (a unique key, a foreign key).
PG_INTEGRITY = "23"
#: SQLSTATE classes of the database's own trouble (connection exception, authorization refused, no such
#: database, insufficient resources, operator intervention: a shutdown, a statement timeout; system error,
#: internal error); with no code at all (the socket's), an outage rather than the statement's fault.
_OUTAGE_CLASSES = frozenset({"08", "28", "3D", "53", "57", "58", "XX"})
#: How long closing PostgreSQL's writer waits for the writes in flight before it cancels them.
CLOSE_WAIT_SECONDS = 10.0


def _pg_code(exc: BaseException) -> str:
    """PostgreSQL's SQLSTATE of ``exc`` (wrapped by SQLAlchemy or the driver's own), or ''."""
    code = getattr(getattr(exc, "orig", None), "sqlstate", None) or getattr(getattr(exc, "orig", None), "pgcode", None)
    if code is None and type(exc).__module__.startswith("asyncpg"):
        code = getattr(exc, "sqlstate", None)
    return code if isinstance(code, str) else ""


def _driver_error(exc: BaseException) -> bool:
    return type(exc).__module__.startswith("asyncpg")


def _pg_outage(exc: BaseException) -> bool:
    """Whether a driver's error is the database's trouble (a connection lost or refused, the server shutting
    down, out of resources), not the statement's: the connection is then dropped from the pool."""
    if unavailable(exc) is None:
        return False
    code = _pg_code(exc)
    return not code or code[:2] in _OUTAGE_CLASSES


def _reason(exc: BaseException) -> BaseException:
    return getattr(exc, "orig", None) or exc


class PgWriter:
    """PostgreSQL: one transaction per operation, retried on deadlock/serialization failure.

    Each write runs in a task of its own that the caller awaits through ``asyncio.shield``: cancelling the caller
    mid-transaction would roll the write back (a call's span lost when its client left just as the call ended,
    its sequence id a hole) where SQLite's writer finishes it. ``close`` waits for the writes in flight."""

    def __init__(self, engine: AsyncEngine, *, attempts: int = 5) -> None:
        self._engine = engine
        self._attempts = attempts
        self._running: dict[asyncio.Task[Any], float] = {}  # each write in flight → when it began
        self.stats = WriteStats()

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        """Let the writes in flight end (their callers may have stopped waiting) before the pool is disposed of;
        after ``CLOSE_WAIT_SECONDS`` those left are cancelled: a database that stopped answering must not hold up
        the process's exit for ever."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CLOSE_WAIT_SECONDS
        while self._running:
            _, left = await asyncio.wait(set(self._running), timeout=max(0.0, deadline - loop.time()))
            if left and loop.time() >= deadline:
                for task in left:
                    task.cancel()
                await asyncio.gather(*left, return_exceptions=True)
                return

    async def submit(self, op: Operation[T]) -> T:
        async def once() -> T:
            async with self._engine.begin() as conn:
                return await conn.run_sync(op)

        return await self._shielded(once)

    async def submit_direct(self, op: Callable[[Any], Awaitable[T]]) -> T:
        """``op`` on the driver's own connection (asyncpg), in no transaction: each statement it runs is one
        transaction and one round trip, where SQLAlchemy's ``begin`` adds two more (BEGIN, COMMIT). For the call
        path's single-statement writes (``store.sql.pg_calls``); retried, shielded and its failures told as
        ``submit``'s are."""

        async def once() -> T:
            async with self._engine.connect() as conn:
                raw = await conn.get_raw_connection()
                try:
                    return await op(raw.driver_connection)
                except Exception as exc:
                    if _pg_outage(exc):
                        # SQLAlchemy does not see the driver's errors: a connection the server dropped (a
                        # restart, an outage) is put out of the pool here, or the next write would fail on it too
                        await conn.invalidate()
                    raise

        return await self._shielded(once)

    async def _shielded(self, once: Callable[[], Awaitable[T]]) -> T:
        task = asyncio.create_task(self._run(once))
        self._running[task] = time.monotonic()
        task.add_done_callback(self._forget)
        return await asyncio.shield(task)

    def _forget(self, task: asyncio.Task[Any]) -> None:
        self._running.pop(task, None)
        if not task.cancelled():
            # Taken here: a write whose caller left has nobody to tell of its failure, and asyncio would log the
            # failure's traceback as an exception never retrieved (the database's failures are logged, rate
            # limited, where callers get them).
            task.exception()

    def waiting_since(self) -> float | None:
        """When the oldest write in flight began (a row lock, a database that stopped answering)."""
        return min(self._running.values(), default=None)

    async def _run(self, once: Callable[[], Awaitable[T]]) -> T:
        for attempt in range(1, self._attempts + 1):
            started = time.perf_counter()
            try:
                result = await once()
                self.stats.record(1, time.perf_counter() - started)
                return result
            except Exception as exc:  # SQLAlchemy's, the driver's own (``submit_direct``) or the socket's
                code = _pg_code(exc)
                if code in RETRYABLE_PG_CODES and attempt < self._attempts:
                    await asyncio.sleep(0.005 * attempt)
                    continue
                if code.startswith(PG_DATA_EXCEPTION):  # the request's, not the database's
                    raise StoreValidationError(f"a value does not fit its column: {_reason(exc)}") from exc
                if code.startswith(PG_INTEGRITY) and not isinstance(exc, DBAPIError):  # SQLAlchemy's: Store._write
                    raise ConflictError(f"the write conflicts with stored data: {exc}") from exc
                if _driver_error(exc) and not (_pg_outage(exc) or code.startswith("40")):
                    # the driver's own error, of the statement (SQL the server refuses: a bug), not an outage
                    raise RuntimeError(f"the database refused the statement: {exc}") from exc
                failure = unavailable(exc)
                if failure is None:  # a conflict (``Store._write`` says so), a refusal of the store's, or a bug
                    raise
                raise failure from exc
        raise AssertionError("unreachable")
