"""The queue part of ``Store`` (``store.sql.queue``): enqueues, claims (waiting up to a bound for a task to
appear, woken by every enqueue) and direct starts of rollouts and attempts."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from sqlalchemy import Connection

from rollway.store.db import limits
from rollway.store.errors import StoreValidationError
from rollway.store.parts.plumbing import StorePlumbing
from rollway.store.parts.reads import MAX_WAIT_SECONDS
from rollway.store.schemas import ApiKey, AttemptedRollout, ClaimFilter, Rollout, TaskSpec
from rollway.store.signals import Signal
from rollway.store.sql import convert, enqueue, keys, matching, queue

T = TypeVar("T")


class QueueMixin(StorePlumbing):
    queued: Signal  # notified by every enqueue and status change: a claim waiting for a task looks again
    poll_interval: float

    async def enqueue(
        self, tasks: Sequence[TaskSpec | Mapping[str, Any]], idempotency_key: str | None = None
    ) -> list[Rollout]:
        """Queue tasks (``group_size`` expands); a client ``rollout_id`` that exists is returned as stored. With
        ``idempotency_key``, the same call again (a client's retry) returns what the first made instead of
        queueing the tasks twice; the key sent with other tasks is a ``ConflictError``."""
        specs = [t if isinstance(t, TaskSpec) else TaskSpec.model_validate(t) for t in tasks]
        if not specs:
            return []
        for spec in specs:
            limits.check_task(spec)
        now = self.clock()
        rows = await self._write(lambda conn: enqueue.enqueue(conn, specs, now, idempotency_key))
        self.queued.notify()
        return [convert.rollout(r) for r in rows]

    async def claim(
        self,
        worker_id: str | None = None,
        limit: int = 1,
        wait_seconds: float = 0.0,
        idempotency_key: str | None = None,
        where: ClaimFilter | None = None,
    ) -> list[AttemptedRollout]:
        """Take up to ``limit`` queued rollouts, waiting up to ``wait_seconds`` (≤ 60) for one to appear. The
        same ``idempotency_key`` again returns what the first claim with it took (``queue.claim``). ``where``:
        only the rollouts it admits (mode, group, task metadata)."""
        key = idempotency_key
        limits.check_worker_id(worker_id)
        if where is not None:
            matching.checked(where.metadata)
        return await self._claim_waiting(
            limit, wait_seconds, lambda conn: queue.claim(conn, worker_id, limit, self.clock(), key=key, where=where)
        )

    async def claim_with_keys(
        self,
        worker_id: str | None = None,
        limit: int = 1,
        wait_seconds: float = 0.0,
        idempotency_key: str | None = None,
        where: ClaimFilter | None = None,
    ) -> list[tuple[AttemptedRollout, str]]:
        """``claim``, and in the same transaction a rollout-scoped gateway key for each attempt (the key itself,
        returned only here: the store keeps its hash). A repeated claim gets new keys, and those that earlier
        tries got are revoked (``keys.attempt_keys``). ``where``: only the rollouts it admits."""
        limits.check_worker_id(worker_id)
        if where is not None:
            matching.checked(where.metadata)
        arrived = None if idempotency_key is None else self.clock()

        def op(conn: Connection) -> list[tuple[AttemptedRollout, ApiKey, str]]:
            now = self.clock()
            claimed = queue.claim(conn, worker_id, limit, now, key=idempotency_key, where=where)
            minted = keys.attempt_keys(conn, claimed, now, arrived=arrived)
            return [(a, record, plain) for a, (record, plain) in zip(claimed, minted, strict=True)]

        handed = await self._claim_waiting(limit, wait_seconds, op)
        self._keys_minted([(record, plain) for _, record, plain in handed])
        return [(a, plain) for a, _, plain in handed]

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
        limits.check_task(spec)
        limits.check_worker_id(worker_id)
        now = self.clock()
        return await self._write(lambda conn: queue.start_rollout(conn, spec, worker_id, now, idempotency_key))

    async def start_attempt(
        self, rollout_id: str, worker_id: str | None = None, idempotency_key: str | None = None
    ) -> AttemptedRollout:
        limits.check_worker_id(worker_id)
        now, key = self.clock(), idempotency_key
        return await self._write(lambda conn: queue.start_attempt(conn, rollout_id, worker_id, now, key))
