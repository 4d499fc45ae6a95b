"""The lifecycle part of ``Store`` (``store.sql.lifecycle``): an attempt's reported outcome, metadata and
heartbeats, a rollout's cancellation, and the watchdog's sweeps (``store.sql.watchdog``), run once per interval
by the loop ``Store.open`` starts."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection

from rollway.store.db import limits, models
from rollway.store.errors import ConflictError, StoreValidationError, UnavailableError
from rollway.store.exports import REWARD_STAMPED
from rollway.store.parts.plumbing import StorePlumbing
from rollway.store.schemas import Attempt, Rollout, Span
from rollway.store.sql import controlled, convert, keyed_spans, spans, watchdog
from rollway.store.sql.lifecycle import (
    apply_attempt_status,
    load_attempt,
    load_rollout,
    record_heartbeat,
    require_latest,
    set_rollout_status,
)
from rollway.store.states import FROZEN, AttemptStatus, RolloutStatus

log = logging.getLogger("rollway.store")

A = models.attempts


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()


class LifecycleMixin(StorePlumbing):
    watchdog_interval: float
    span_observer: Callable[[int], None] | None

    async def update_attempt(
        self,
        rollout_id: str,
        attempt_id: str = "latest",
        *,
        status: AttemptStatus | str | None = None,
        metadata: Any = UNSET,
        worker_id: Any = UNSET,
        reward: Span | None = None,
        idempotency_key: str | None = None,
    ) -> Attempt:
        """Report an attempt's outcome or metadata; the latest attempt's status drives the rollout.

        ``reward`` (a reward span, its attempt left to this call) is written in the same transaction, before the
        status changes: a rollout never reads as finished without the reward its worker sent with the end. With
        ``idempotency_key`` the span is written as ``add_spans`` writes a keyed request's, so a retry of the
        request records it once."""
        try:
            new_status = AttemptStatus(status) if status is not None else None
        except ValueError as exc:
            raise StoreValidationError(f"unknown attempt status '{status}'") from exc
        if metadata is not UNSET and metadata is not None and not isinstance(metadata, dict):
            raise StoreValidationError("attempt metadata must be an object")
        if metadata is not UNSET:
            limits.check_finite(metadata, "attempt metadata")
        limits.check_worker_id(worker_id)
        now = self.clock()
        wrote = [0]  # spans written (the reward), for ``span_observer``

        def op(conn: Connection) -> Attempt:
            rollout = load_rollout(conn, rollout_id)
            attempt = load_attempt(conn, rollout, attempt_id)
            require_latest(rollout, attempt)
            extra: dict[str, Any] = {}
            if metadata is not UNSET:
                extra["metadata"] = metadata
            if worker_id is not UNSET:
                extra["worker_id"] = worker_id
            if reward is not None:  # before the status, so the rollout never reads as ended without it
                reward.attempt_id = attempt["attempt_id"]
                if idempotency_key is None:
                    wrote[:] = [len(spans.add(conn, [reward], now))]
                else:
                    wrote[:] = [keyed_spans.add_keyed(conn, [reward], now, idempotency_key, REWARD_STAMPED)[1]]
                rollout = load_rollout(conn, rollout_id)  # the span's heartbeat may have moved both
                attempt = load_attempt(conn, rollout, attempt["attempt_id"])
            if extra:
                conn.execute(A.update().where(A.c.pk == attempt["pk"]).values(**extra))
            if new_status is not None:
                apply_attempt_status(conn, rollout, attempt, new_status, now)
            return convert.attempt(load_attempt(conn, rollout, attempt["attempt_id"], lock=False))

        result = await self._write(op)
        if wrote[0] and self.span_observer is not None:
            self.span_observer(wrote[0])
        self._notify_all()
        return result

    async def heartbeat(self, rollout_id: str, attempt_id: str = "latest") -> Attempt:
        """An explicit heartbeat: same effect on liveness as a span. A cancelled rollout's heartbeat is a
        ``ConflictError``: its runner is told to stop, and the attempt keeps its status (``states.FROZEN``)."""
        now = self.clock()

        def op(conn: Connection) -> Attempt:
            rollout = load_rollout(conn, rollout_id)
            attempt = load_attempt(conn, rollout, attempt_id)
            require_latest(rollout, attempt)
            if rollout["status"] in FROZEN:
                raise ConflictError(f"rollout '{rollout_id}' is '{rollout['status']}': its attempt takes no heartbeat")
            record_heartbeat(conn, rollout, attempt, now)
            return convert.attempt(load_attempt(conn, rollout, attempt["attempt_id"], lock=False))

        return await self._write(op)

    async def cancel(self, rollout_id: str) -> Rollout:
        """Cancel a rollout: it leaves the queue and is never claimed; a finished rollout cannot be cancelled."""
        now = self.clock()

        def op(conn: Connection) -> Rollout:
            rollout = load_rollout(conn, rollout_id)
            set_rollout_status(conn, rollout, RolloutStatus.CANCELLED, now)
            controlled.ended(conn, rollout_id)  # a controlled rollout's place in its terminal log
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
