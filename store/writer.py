"""Write paths. Every store mutation is an *operation*: a coroutine that takes a connection inside an open
transaction. How operations reach the database depends on the engine:

- SQLite: one ``BatchWriter`` task owns the only writing connection. Operations queue up; each turn of the
  writer takes everything queued (up to a bound), runs it in one ``BEGIN IMMEDIATE`` transaction, each
  operation inside its own savepoint so one failure does not undo its neighbours, and commits once. A burst
  of span writes therefore costs one commit. Callers get their result only after the commit.
- PostgreSQL: ``DirectWriter`` runs each operation in its own transaction from the pool and retries the
  transaction on deadlock or serialization failure; row locks (``FOR UPDATE [SKIP LOCKED]``) do the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from store.errors import StoreError, UnavailableError

log = logging.getLogger("rollway.store")

T = TypeVar("T")
Operation = Callable[[AsyncConnection], Awaitable[T]]

RETRYABLE_PG_CODES = frozenset({"40001", "40P01"})  # serialization_failure, deadlock_detected


@dataclass
class WriteStats:
    """What the write path did, for metrics and benchmarks."""

    transactions: int = 0
    operations: int = 0
    last_batch_size: int = 0
    commit_seconds_total: float = 0.0
    batch_sizes: list[int] = field(default_factory=list)

    def record(self, size: int, seconds: float) -> None:
        self.transactions += 1
        self.operations += size
        self.last_batch_size = size
        self.commit_seconds_total += seconds
        if len(self.batch_sizes) < 10_000:
            self.batch_sizes.append(size)


class Writer(Protocol):
    stats: WriteStats

    async def submit(self, op: Operation[T]) -> T: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...


class BatchWriter:
    """The single SQLite writer with group commit (see module docstring)."""

    def __init__(self, engine: AsyncEngine, *, max_batch: int = 256) -> None:
        self._engine = engine
        self._max_batch = max_batch
        self._queue: asyncio.Queue[tuple[Operation[Any], asyncio.Future[Any]]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self.stats = WriteStats()

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="rollway-store-writer")

    async def close(self) -> None:
        if self._task is None:
            return
        # Let queued operations finish, then stop.
        while not self._queue.empty():
            await asyncio.sleep(0)
            if self._task.done():
                break
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        while not self._queue.empty():
            _, fut = self._queue.get_nowait()
            if not fut.done():
                fut.set_exception(UnavailableError("the store is closed"))

    async def submit(self, op: Operation[T]) -> T:
        if self._task is None or self._task.done():
            raise UnavailableError("the store is closed")
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((op, fut))
        # The write goes on even if the caller stops waiting: it may already be in a transaction.
        return await asyncio.shield(fut)

    async def _run(self) -> None:
        async with self._engine.connect() as conn:
            while True:
                batch = [await self._queue.get()]
                while len(batch) < self._max_batch and not self._queue.empty():
                    batch.append(self._queue.get_nowait())
                await self._commit(conn, batch)

    async def _commit(
        self, conn: AsyncConnection, batch: list[tuple[Operation[Any], asyncio.Future[Any]]]
    ) -> None:
        started = time.perf_counter()
        outcomes: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = []
        try:
            if len(batch) == 1:
                op, fut = batch[0]
                try:
                    async with conn.begin():
                        outcomes.append((fut, await op(conn), None))
                except StoreError as exc:  # rolled back: nothing half-written
                    if not fut.done():
                        fut.set_exception(exc)
                    return
            else:
                async with conn.begin():
                    for op, fut in batch:
                        try:
                            async with conn.begin_nested():
                                outcomes.append((fut, await op(conn), None))
                        except StoreError as exc:
                            outcomes.append((fut, None, exc))
                        except DBAPIError as exc:
                            if isinstance(exc, OperationalError):
                                raise  # the connection or file is in trouble: fail the whole batch
                            log.exception("store operation failed")
                            outcomes.append((fut, None, exc))
        except Exception as exc:  # the transaction itself failed: nothing in it was written
            log.exception("store write transaction failed")
            failure: BaseException = exc
            if isinstance(exc, OperationalError):
                failure = UnavailableError(f"database write failed: {exc.orig}")
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(failure)
            return
        self.stats.record(len(batch), time.perf_counter() - started)
        for fut, result, error in outcomes:
            if fut.done():
                continue
            if error is None:
                fut.set_result(result)
            else:
                fut.set_exception(error)


class DirectWriter:
    """PostgreSQL: one transaction per operation, retried on deadlock/serialization failure."""

    def __init__(self, engine: AsyncEngine, *, attempts: int = 5) -> None:
        self._engine = engine
        self._attempts = attempts
        self.stats = WriteStats()

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def submit(self, op: Operation[T]) -> T:
        for attempt in range(1, self._attempts + 1):
            started = time.perf_counter()
            try:
                async with self._engine.begin() as conn:
                    result = await op(conn)
                self.stats.record(1, time.perf_counter() - started)
                return result
            except DBAPIError as exc:
                code = getattr(exc.orig, "sqlstate", None) or getattr(exc.orig, "pgcode", None)
                if code in RETRYABLE_PG_CODES and attempt < self._attempts:
                    await asyncio.sleep(0.005 * attempt)
                    continue
                if exc.connection_invalidated or isinstance(exc, OperationalError):
                    raise UnavailableError(f"database write failed: {exc.orig}") from exc
                raise
        raise AssertionError("unreachable")
