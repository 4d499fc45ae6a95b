"""Write paths. Every store mutation is an *operation*: a plain function that takes a SQLAlchemy
``Connection`` inside an open transaction. How operations reach the database depends on the engine:

- SQLite: ``BatchWriter`` is the only writer. Operations queue up; each turn takes everything queued (up to a
  bound) and runs it in one ``BEGIN IMMEDIATE`` transaction — each operation inside its own savepoint so
  one failure (a refusal, or any other exception but the database's own trouble) does not undo its neighbours —
  and commits once: a burst of span writes costs one commit.
  Callers get their result only after the commit. A small batch runs on the event loop's thread (it is short;
  a thread hop costs more than the work); a large one (``OFFLOAD_BATCH``: under load) runs in the writer's own
  thread, one hop for the whole transaction, while the loop goes on relaying streams (sqlite3 lets go of the
  GIL while SQLite works; docs/benchmarks.md, "The load of an RL step"). The write lock is taken on the loop
  without blocking: when another process holds it, the writer backs off and retries asynchronously. An
  operation submitted while nothing is queued or in flight runs at once in the caller's turn of the loop (at
  most one per turn, so a burst still shares a commit).
- PostgreSQL: ``PgWriter`` (``store.db.pg_writer``) runs each operation in its own transaction from the pool
  (``run_sync`` over asyncpg) and retries it on deadlock or serialization failure; row locks (``FOR UPDATE [SKIP
  LOCKED]``) do the rest.

On both engines a write goes on when its caller stops waiting (its task cancelled: a gateway call whose client
left while the call's span was being written): it either commits or fails as a whole, never half-way through
because of who was waiting for it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import random
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import OperationalError

from rollway.store.db.faults import unavailable
from rollway.store.errors import UnavailableError

log = logging.getLogger("rollway.store")

T = TypeVar("T")
Operation = Callable[[Connection], T]

LOCK_WAIT_SECONDS = 30.0
#: How long a writer finding the file locked by another process asks again at once, each turn of the event
#: loop (serving what else is ready in between), before it backs off: another process's transaction usually
#: ends within it, and the loop's timers cannot wait less than a millisecond.
LOCK_SPIN_SECONDS = 0.002
#: Batches of at least this many operations run in the writer's thread rather than on the event loop: under load
#: (large batches) the loop relays streams while SQLite writes; a small batch costs less than the thread hop.
OFFLOAD_BATCH = 16


@dataclass
class WriteStats:
    """What the write path did, for metrics and benchmarks."""

    transactions: int = 0
    operations: int = 0
    last_batch_size: int = 0
    commit_seconds_total: float = 0.0
    lock_waits: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    observer: Callable[[int, float], None] | None = None  # told (batch size, seconds) of each commit

    def record(self, size: int, seconds: float) -> None:
        if self.observer is not None:
            self.observer(size, seconds)
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

    def waiting_since(self) -> float | None:
        """When (``time.monotonic``) the write waiting longest for the database began to wait, or None."""
        ...


def _is_locked(exc: BaseException) -> bool:
    text = str(getattr(exc, "orig", exc)).lower()
    return "locked" in text or "busy" in text


_LOCKED = object()  # the write lock was taken by another process


def _unavailable(exc: BaseException) -> UnavailableError:
    return unavailable(exc) or UnavailableError(f"database write failed: {getattr(exc, 'orig', exc)}")


class BatchWriter:
    """The single SQLite writer with group commit (see module docstring)."""

    def __init__(self, engine: Engine, *, max_batch: int = 256) -> None:
        self._engine = engine
        self._max_batch = max_batch
        self._queue: asyncio.Queue[tuple[Operation[Any], asyncio.Future[Any]] | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._conn: Connection | None = None
        self._closing = False
        self._busy = False  # a batch is in flight (possibly waiting for the lock)
        self._open = asyncio.Event()  # clear while ``paused``: no transaction starts
        self._open.set()
        self._idle = asyncio.Event()  # set while no batch is in flight
        self._idle.set()
        self._inline_used = False  # this turn of the event loop already ran a write inline
        self._locked_since: float | None = None  # a batch waits for the write lock another process holds
        self.stats = WriteStats()
        # Runs large batches' statements off the event loop; one thread, as there is one writer connection.
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollway-store-writer")

    async def start(self) -> None:
        if self._task is None:
            self._conn = self._engine.connect()
            self._task = asyncio.create_task(self._run(), name="rollway-store-writer")

    async def close(self) -> None:
        if self._task is None:
            return
        self._closing = True
        self._queue.put_nowait(None)  # queued writes finish first, then the writer stops
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if item is not None and not item[1].done():
                item[1].set_exception(UnavailableError("the store is closed"))
        self._thread.shutdown(wait=True)
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    async def submit(self, op: Operation[T]) -> T:
        if self._task is None or self._task.done() or self._closing:
            raise UnavailableError("the store is closed")
        if not self._busy and not self._inline_used and self._queue.empty() and self._open.is_set():
            # Nothing queued and no batch in flight: run the transaction now, without two hops through the
            # writer task. Only when the write lock is free at once (otherwise the queue and its back-off), and
            # once per turn of the event loop: writes submitted in the same turn (a burst) queue up behind it
            # and share one commit.
            self._inline_used = True
            asyncio.get_running_loop().call_soon(self._allow_inline)
            inline = self._run_inline(op)
            if inline is not _LOCKED:
                return inline  # type: ignore[return-value]
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((op, fut))
        # The write goes on even if the caller stops waiting: it may already be in a transaction.
        return await asyncio.shield(fut)

    async def _run(self) -> None:
        while True:
            first = await self._queue.get()
            if first is None:
                return
            batch = [first]
            stop = False
            while len(batch) < self._max_batch and not self._queue.empty():
                item = self._queue.get_nowait()
                if item is None:
                    stop = True
                    break
                batch.append(item)
            self._busy = True  # from here: a write submitted now queues behind this batch, even during a pause
            await self._open.wait()
            self._idle.clear()  # (no await since the writer was found open)
            try:
                await self._commit(batch)
            finally:
                self._busy = False
                self._idle.set()
            if stop:
                return

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """No write transaction of this writer runs inside (the one in flight finishes first; writes submitted
        meanwhile wait and then share a commit): for work that must hold the file's write lock itself, e.g.
        emptying the write-ahead log, without this writer racing it for the lock."""
        self._open.clear()
        try:
            await self._idle.wait()
            yield
        finally:
            self._open.set()

    def waiting_since(self) -> float | None:
        return self._locked_since

    def _allow_inline(self) -> None:
        self._inline_used = False

    def _run_inline(self, op: Operation[T]) -> T | object:
        """One operation in its own transaction, synchronously; ``_LOCKED`` when another process writes."""
        conn = self._conn
        assert conn is not None
        raw: sqlite3.Connection = conn.connection.driver_connection  # type: ignore[assignment]
        started = time.perf_counter()
        try:
            raw.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            if _is_locked(exc):
                return _LOCKED
            raise _unavailable(exc) from exc
        try:
            result = op(conn)
            raw.execute("COMMIT")
        except BaseException as exc:
            if raw.in_transaction:
                raw.execute("ROLLBACK")
            if isinstance(exc, OperationalError | sqlite3.OperationalError):
                raise _unavailable(exc) from exc
            raise
        self.stats.record(1, time.perf_counter() - started)
        return result

    async def _begin(self, raw: sqlite3.Connection) -> None:
        """``BEGIN IMMEDIATE`` without blocking the loop: back off while another process writes."""
        now = time.monotonic()
        deadline = now + LOCK_WAIT_SECONDS
        spin_until = now + LOCK_SPIN_SECONDS
        delay = 0.001
        try:
            while True:
                try:
                    raw.execute("BEGIN IMMEDIATE")
                    return
                except sqlite3.OperationalError as exc:
                    now = time.monotonic()
                    if not _is_locked(exc) or now > deadline:
                        raise
                    if self._locked_since is None:  # the first refusal of this transaction
                        self.stats.lock_waits += 1
                        self._locked_since = now
                    if now < spin_until:  # another process's transaction: most end within the spin
                        await asyncio.sleep(0)
                        continue
                    await asyncio.sleep(random.uniform(0, delay))
                    delay = min(delay * 2, 0.05)
        finally:
            self._locked_since = None

    async def _commit(self, batch: list[tuple[Operation[Any], asyncio.Future[Any]]]) -> None:
        # Transactions are driven on the sqlite3 connection itself (BEGIN, SAVEPOINT, COMMIT): SQLAlchemy's
        # transaction bookkeeping costs more than the statements. Operations still run through ``conn``.
        conn = self._conn
        assert conn is not None
        raw: sqlite3.Connection = conn.connection.driver_connection  # type: ignore[assignment]
        started = time.perf_counter()
        try:
            await self._begin(raw)
            if len(batch) < OFFLOAD_BATCH:
                outcomes = _apply(batch, conn, raw)
            else:  # a large batch: its statements run while the loop goes on relaying (sqlite3 lets go of the GIL)
                loop = asyncio.get_running_loop()
                outcomes = await loop.run_in_executor(self._thread, _apply, batch, conn, raw)
        except Exception as exc:  # nothing in the transaction was written
            failure: BaseException = exc
            if isinstance(exc, OperationalError | sqlite3.OperationalError):
                failure = _unavailable(exc)
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


def _apply(
    batch: list[tuple[Operation[Any], asyncio.Future[Any]]], conn: Connection, raw: sqlite3.Connection
) -> list[tuple[asyncio.Future[Any], Any, BaseException | None]]:
    """The batch's operations in the transaction begun on ``raw``, each in its own savepoint, and the commit;
    rolled back whole when the file is in trouble. Touches no future: the loop settles them."""
    outcomes: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = []
    try:
        if len(batch) == 1:
            outcomes.append((batch[0][1], batch[0][0](conn), None))
        else:
            for op, fut in batch:
                raw.execute("SAVEPOINT op")
                try:
                    outcomes.append((fut, op(conn), None))
                except Exception as exc:  # this operation only (a refusal, or a bug in it)
                    if isinstance(exc, OperationalError | sqlite3.OperationalError):
                        raise  # the file is in trouble: fail the whole batch
                    raw.execute("ROLLBACK TO op")
                    outcomes.append((fut, None, exc))
                raw.execute("RELEASE op")
        raw.execute("COMMIT")
    except BaseException:
        if raw.in_transaction:
            raw.execute("ROLLBACK")
        raise
    return outcomes
