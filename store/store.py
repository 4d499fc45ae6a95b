"""``Store``: the one object callers use. It owns the engines, the writer, the watchdog loop and the
in-process signals, and turns each public method into one read or one write operation."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from sqlalchemy import Connection, text
from sqlalchemy.exc import DBAPIError, IntegrityError

from rollway.store.db import limits, migrate
from rollway.store.db.engine import PG_POOL_SIZE, Engines, create_engines, migration_engine, open_error
from rollway.store.db.faults import FailureLog, WriteHealth, unavailable
from rollway.store.db.writer import BatchWriter, PgWriter, Writer
from rollway.store.errors import ConflictError, StoreValidationError, UnavailableError
from rollway.store.keepalive import INTERVAL, CallsInFlight
from rollway.store.parts.agents import AgentsMixin
from rollway.store.parts.catalog import CatalogMixin
from rollway.store.parts.edits import EditsMixin
from rollway.store.parts.reads import MAX_WAIT_SECONDS, ReadsMixin
from rollway.store.parts.spans import SpansMixin
from rollway.store.parts.wal import WalMixin
from rollway.store.schemas import (
    Attempt,
    AttemptedRollout,
    Rollout,
    TaskSpec,
)
from rollway.store.signals import Signal
from rollway.store.sql import catalog, convert, queue, reads, watchdog
from rollway.store.sql.lifecycle import (
    apply_attempt_status,
    load_attempt,
    load_rollout,
    record_heartbeat,
    require_latest,
    set_rollout_status,
)
from rollway.store.states import AttemptStatus, RolloutStatus

log = logging.getLogger("rollway.store")

T = TypeVar("T")


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()


class Store(CatalogMixin, EditsMixin, AgentsMixin, SpansMixin, ReadsMixin, WalMixin):
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
        heartbeat of calls in flight (``store.keepalive``; every ``keepalive_interval`` seconds, 0: never). On
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

    # -- queue and lifecycle --------------------------------------------------------------------------

    async def enqueue(
        self, tasks: Sequence[TaskSpec | Mapping[str, Any]], idempotency_key: str | None = None
    ) -> list[Rollout]:
        """Queue tasks (``group_size`` expands); a client ``rollout_id`` that exists is returned as stored. With
        ``idempotency_key``, the same call again (a client's retry) returns what the first made instead of
        queueing the tasks twice; the key sent with other tasks is a ``ConflictError``."""
        specs = [t if isinstance(t, TaskSpec) else TaskSpec.model_validate(t) for t in tasks]
        if not specs:
            return []
        now = self.clock()
        rows = await self._write(lambda conn: queue.enqueue(conn, specs, now, idempotency_key))
        self.queued.notify()
        return [convert.rollout(r) for r in rows]

    async def claim(
        self,
        worker_id: str | None = None,
        limit: int = 1,
        wait_seconds: float = 0.0,
        idempotency_key: str | None = None,
    ) -> list[AttemptedRollout]:
        """Take up to ``limit`` queued rollouts, waiting up to ``wait_seconds`` (≤ 60) for one to appear. The
        same ``idempotency_key`` again returns what the first claim with it took (``queue.claim``)."""
        key = idempotency_key
        limits.check_worker_id(worker_id)
        return await self._claim_waiting(
            limit, wait_seconds, lambda conn: queue.claim(conn, worker_id, limit, self.clock(), key=key)
        )

    async def claim_with_keys(
        self,
        worker_id: str | None = None,
        limit: int = 1,
        wait_seconds: float = 0.0,
        idempotency_key: str | None = None,
    ) -> list[tuple[AttemptedRollout, str]]:
        """``claim``, and in the same transaction a rollout-scoped gateway key for each attempt (the key itself,
        returned only here: the store keeps its hash). A repeated claim gets new keys, and those that earlier
        tries got are revoked (``catalog.attempt_keys``)."""
        limits.check_worker_id(worker_id)
        arrived = None if idempotency_key is None else self.clock()

        def op(conn: Connection) -> list[tuple[AttemptedRollout, str]]:
            now = self.clock()
            claimed = queue.claim(conn, worker_id, limit, now, key=idempotency_key)
            return list(zip(claimed, catalog.attempt_keys(conn, claimed, now, arrived=arrived), strict=True))

        return await self._claim_waiting(limit, wait_seconds, op)

    async def _claim_waiting(self, limit: int, wait_seconds: float, op: Callable[[Connection], list[T]]) -> list[T]:
        if limit < 1 or limit > 1000:
            raise StoreValidationError(f"limit must be between 1 and 1000, got {limit}")
        if wait_seconds < 0:
            raise StoreValidationError("wait_seconds must not be negative")
        deadline = time.monotonic() + min(wait_seconds, MAX_WAIT_SECONDS)
        while True:
            generation = self.queued.generation()
            claimed = await self._write(op)
            remaining = deadline - time.monotonic()
            if claimed or remaining <= 0:
                return claimed
            await Signal.wait(generation, min(remaining, self.poll_interval))

    async def start_rollout(
        self, task: TaskSpec | Mapping[str, Any], worker_id: str | None = None, idempotency_key: str | None = None
    ) -> AttemptedRollout:
        spec = task if isinstance(task, TaskSpec) else TaskSpec.model_validate(task)
        limits.check_worker_id(worker_id)
        now = self.clock()
        return await self._write(lambda conn: queue.start_rollout(conn, spec, worker_id, now, idempotency_key))

    async def start_attempt(
        self, rollout_id: str, worker_id: str | None = None, idempotency_key: str | None = None
    ) -> AttemptedRollout:
        limits.check_worker_id(worker_id)
        now, key = self.clock(), idempotency_key
        return await self._write(lambda conn: queue.start_attempt(conn, rollout_id, worker_id, now, key))

    async def update_attempt(
        self,
        rollout_id: str,
        attempt_id: str = "latest",
        *,
        status: AttemptStatus | str | None = None,
        metadata: Any = UNSET,
        worker_id: Any = UNSET,
    ) -> Attempt:
        """Report an attempt's outcome or metadata; the latest attempt's status drives the rollout."""
        try:
            new_status = AttemptStatus(status) if status is not None else None
        except ValueError as exc:
            raise StoreValidationError(f"unknown attempt status '{status}'") from exc
        if metadata is not UNSET and metadata is not None and not isinstance(metadata, dict):
            raise StoreValidationError("attempt metadata must be an object")
        limits.check_worker_id(worker_id)
        now = self.clock()

        def op(conn: Connection) -> Attempt:
            rollout = load_rollout(conn, rollout_id)
            attempt = load_attempt(conn, rollout, attempt_id)
            require_latest(rollout, attempt)
            extra: dict[str, Any] = {}
            if metadata is not UNSET:
                extra["metadata"] = metadata
            if worker_id is not UNSET:
                extra["worker_id"] = worker_id
            if extra:
                conn.execute(reads.A.update().where(reads.A.c.pk == attempt["pk"]).values(**extra))
            if new_status is not None:
                apply_attempt_status(conn, rollout, attempt, new_status, now)
            return convert.attempt(load_attempt(conn, rollout, attempt["attempt_id"], lock=False))

        result = await self._write(op)
        self._notify_all()
        return result

    async def heartbeat(self, rollout_id: str, attempt_id: str = "latest") -> Attempt:
        """An explicit heartbeat: same effect on liveness as a span."""
        now = self.clock()

        def op(conn: Connection) -> Attempt:
            rollout = load_rollout(conn, rollout_id)
            attempt = load_attempt(conn, rollout, attempt_id)
            require_latest(rollout, attempt)
            record_heartbeat(conn, rollout, attempt, now)
            return convert.attempt(load_attempt(conn, rollout, attempt["attempt_id"], lock=False))

        return await self._write(op)

    async def cancel(self, rollout_id: str) -> Rollout:
        """Cancel a rollout: it leaves the queue and is never claimed; a finished rollout cannot be cancelled."""
        now = self.clock()

        def op(conn: Connection) -> Rollout:
            rollout = load_rollout(conn, rollout_id)
            set_rollout_status(conn, rollout, RolloutStatus.CANCELLED, now)
            return convert.rollout(load_rollout(conn, rollout_id, lock=False))

        result = await self._write(op)
        self._notify_all()
        return result

    async def sweep(self, *, force: bool = False) -> int:
        """Run the watchdog once (if no process swept within the interval, or when ``force``)."""
        now = self.clock()

        def op(conn: Connection) -> int:
            if not force and not watchdog.claim_turn(conn, now, self.watchdog_interval * 0.9):
                return 0
            return watchdog.sweep(conn, now)

        changed = await self._write(op)
        if changed:
            self._notify_all()
        return changed

    async def _watchdog_loop(self) -> None:
        while True:
            await asyncio.sleep(self.watchdog_interval)
            try:
                await self.sweep()
            except UnavailableError:  # logged by ``_write``; the next sweep tries again
                continue
            except Exception:
                log.exception("watchdog sweep failed")

    def _notify_all(self) -> None:
        self.finished.notify()
        self.queued.notify()
