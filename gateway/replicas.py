"""This gateway process as one of the replicas serving on the database: it reports its calls in flight
(``ModelRegistry.snapshot``) so that a drain asked of any replica waits for them too (``store.replicas``).

The reporter looks every ``TICK`` seconds: it writes a report when its counts changed, when the catalog moved
(a swap or pause somewhere: a drain there waits for a report written after it) and at least every
``HEARTBEAT`` seconds (a replica not heard from for ``store.replicas.STALE_SECONDS`` is taken for gone). An idle
replica reads the catalog revision four times a second and writes once every ``HEARTBEAT``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Mapping

from gateway.registry import ModelRegistry
from store import Store, StoreError
from store.replicas import ReplicaInfo

log = logging.getLogger("rollway.replicas")

TICK = 0.25
HEARTBEAT = 2.0


def new_replica() -> ReplicaInfo:
    return ReplicaInfo(
        replica_id=f"gw-{uuid.uuid4().hex[:16]}", host=socket.gethostname(), pid=os.getpid(), started_time=time.time()
    )


class ReplicaReporter:
    def __init__(self, store: Store, registry: ModelRegistry, info: ReplicaInfo) -> None:
        self._store = store
        self._registry = registry
        self.info = info
        self._last: Mapping[str, Mapping[str, int]] | None = None  # the counts last written
        self._reported_at = float("-inf")
        self._revision = -1
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    async def start(self) -> None:
        await self.report()  # the replica exists from its start: a drain elsewhere waits for its first report
        self._task = asyncio.create_task(self._run(), name="rollway-replica-reporter")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(StoreError):
            await self._store.leave_replica(self.info.replica_id)

    async def report(self) -> None:
        """Write this process's counts now (taken inside the store's transaction, after the revision)."""
        taken: dict[str, dict[str, int]] = {}

        def snapshot() -> dict[str, dict[str, int]]:
            taken.update(self._registry.snapshot())
            return taken

        revision = await self._store.report_replica(self.info, snapshot)
        self._last, self._reported_at, self._revision = taken, time.monotonic(), revision
        self._registry.observe(revision)

    async def tick(self) -> None:
        """One look: report if the counts changed, the catalog moved or the heartbeat is due."""
        due = self._registry.snapshot() != self._last or time.monotonic() - self._reported_at >= HEARTBEAT
        if not due:
            revision = await self._store.catalog_revision()
            self._registry.observe(revision)  # a change made elsewhere: the cache need not wait for a call
            due = revision > self._revision
        if due:
            await self.report()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(TICK)
            try:
                await self.tick()
            except Exception as exc:  # the store is down or locked for long: keep serving, say so once
                if not self._failing:
                    reason = exc.message if isinstance(exc, StoreError) else repr(exc)
                    log.warning("could not report this replica's calls in flight: %s", reason)
                self._failing = True
            else:
                self._failing = False
