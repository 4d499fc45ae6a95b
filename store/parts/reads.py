"""The read part of ``Store``: rollouts, attempts, groups, workers, counts and exports, each one read operation,
and ``wait_for_rollouts``, which reads again each time a rollout finishes (or every ``poll_interval``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection

from rollway.store.errors import NotFoundError, StoreValidationError
from rollway.store.exports import ExportPage, ExportQuery, ExportRollout
from rollway.store.parts.plumbing import StorePlumbing
from rollway.store.schemas import Attempt, Page, Rollout, StoreStats, Worker
from rollway.store.signals import Signal
from rollway.store.sql import convert, exports, reads
from rollway.store.sql.lifecycle import load_rollout
from rollway.store.states import FINISHED

#: The longest a caller waits in one call (for rollouts to finish, for a task to claim).
MAX_WAIT_SECONDS = 60.0


class ReadsMixin(StorePlumbing):
    finished: Signal
    poll_interval: float

    async def get_rollout(self, rollout_id: str, *, with_attempts: bool = False) -> Rollout:
        return await self._read(lambda conn: reads.get_rollout(conn, rollout_id, with_attempts=with_attempts))

    async def list_rollouts(self, **filters: Any) -> Page[Rollout]:
        return await self._read(lambda conn: reads.list_rollouts(conn, **filters))

    async def sorted_rollouts(self, **query: Any) -> tuple[list[Rollout], int]:
        """A page of rollouts in a chosen order, and the number matching (see ``store.sql.reads.sorted_rollouts``)."""
        return await self._read(lambda conn: reads.sorted_rollouts(conn, **query))

    async def primary_rewards(self, rollout_ids: Sequence[str]) -> dict[str, float]:
        """The primary reward of each of ``rollout_ids`` that has one (its latest attempt's last)."""
        return await self._read(lambda conn: reads.primary_rewards(conn, rollout_ids))

    async def list_attempts(self, rollout_id: str) -> list[Attempt]:
        def op(conn: Connection) -> list[Attempt]:
            load_rollout(conn, rollout_id, lock=False)
            return reads.list_attempts(conn, rollout_id)

        return await self._read(op)

    async def get_attempt(self, rollout_id: str, attempt_id: str = "latest") -> Attempt:
        return await self._read(lambda conn: reads.get_attempt(conn, rollout_id, attempt_id))

    async def get_group(self, group_id: str) -> list[Rollout]:
        return await self._read(lambda conn: reads.group(conn, group_id))

    async def list_workers(self) -> list[Worker]:
        return await self._read(reads.list_workers)

    async def get_worker(self, worker_id: str) -> Worker:
        return await self._read(lambda conn: reads.get_worker(conn, worker_id))

    async def status_counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """(rollouts by status, attempts by status): cheap enough for every metrics scrape."""
        return await self._read(reads.status_counts)

    async def stats(self) -> StoreStats:
        return await self._read(reads.stats)

    async def export_rollouts(self, query: ExportQuery | None = None, *, with_spans: bool = True) -> ExportPage:
        """The finished rollouts ``query`` asks for (by default the first 100, whole complete groups), in finish
        order after its cursor, each with the spans of its latest attempt; see ``store.sql.exports``."""
        asked = query or ExportQuery()
        return await self._read(lambda conn: exports.export(conn, asked, with_spans=with_spans))

    async def export_spans(self, rollouts: list[ExportRollout]) -> None:
        """Fill in the spans of exported rollouts read ``with_spans=False`` (``store.sql.exports.attach_spans``)."""
        await self._read(lambda conn: exports.attach_spans(conn, rollouts))

    async def wait_for_rollouts(self, rollout_ids: Sequence[str], timeout: float) -> tuple[list[Rollout], list[str]]:
        """Block until every rollout finished or ``timeout`` (≤ 60 s) passed: (finished, pending ids)."""
        if timeout < 0:
            raise StoreValidationError("timeout must not be negative")
        wanted = list(dict.fromkeys(rollout_ids))
        deadline = time.monotonic() + min(timeout, MAX_WAIT_SECONDS)
        while True:
            generation = self.finished.generation()
            rows = await self._read(lambda conn: reads.statuses(conn, wanted))
            unknown = [r for r in wanted if r not in rows]
            if unknown:
                raise NotFoundError(f"rollouts not found: {', '.join(unknown[:10])}")
            done = [convert.rollout(rows[r]) for r in wanted if rows[r]["status"] in FINISHED]
            pending = [r for r in wanted if rows[r]["status"] not in FINISHED]
            remaining = deadline - time.monotonic()
            if not pending or remaining <= 0:
                return done, pending
            await Signal.wait(generation, min(remaining, self.poll_interval))
