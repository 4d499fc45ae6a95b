"""The edit part of ``Store`` (``store.sql.edits``): rollout and worker edits, latest attempts of many rollouts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rollway.store.db import limits
from rollway.store.parts.plumbing import StorePlumbing
from rollway.store.schemas import Attempt, Rollout, Worker
from rollway.store.sql import edits


class EditsMixin(StorePlumbing):
    async def update_rollout(self, rollout_id: str, changes: Mapping[str, Any]) -> Rollout:
        """Change a rollout's input, mode, resources_id, config, metadata or status (absent keys: unchanged)."""
        now = self.clock()
        wanted = dict(changes)
        for field in ("input", "metadata"):
            limits.check_finite(wanted.get(field), field)
        result = await self._write(lambda conn: edits.update_rollout(conn, rollout_id, wanted, now))
        if "status" in wanted:
            self._notify_all()
        return result

    async def worker_heartbeat(self, worker_id: str, heartbeat_stats: Any = None, *, set_stats: bool = True) -> Worker:
        """Record a worker's heartbeat (and its stats when ``set_stats``); the worker is created when new."""
        limits.check_worker_id(worker_id)
        now = self.clock()
        return await self._write(
            lambda conn: edits.update_worker(conn, worker_id, heartbeat_stats, now, set_stats=set_stats)
        )

    async def latest_attempts(self, rollout_ids: Sequence[str]) -> dict[str, Attempt]:
        """The latest attempt of each rollout that has one."""
        ids = list(rollout_ids)
        return await self._read(lambda conn: edits.latest_attempts(conn, ids))
