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
from collections.abc import Awaitable, Callable, Mapping

from rollway.gateway.registry import ModelRegistry
from rollway.store import Store, StoreError
from rollway.store.replicas import STALE_SECONDS, ReplicaInfo

log = logging.getLogger("rollway.replicas")

TICK = 0.25
HEARTBEAT = 2.0
LEAVE_SECONDS = 5.0


def _reason(exc: BaseException) -> str:
    if isinstance(exc, StoreError):
        return exc.message
    return "timed out" if isinstance(exc, TimeoutError) else repr(exc)


def new_replica() -> ReplicaInfo:
    return ReplicaInfo(
        replica_id=f"gw-{uuid.uuid4().hex[:16]}", host=socket.gethostname(), pid=os.getpid(), started_time=time.time()
    )


class ReplicaReporter:
    """Reports this replica's calls in flight (see the module docstring). ``follow``: called after each report
    (the catalog moved, or the heartbeat): what this replica does for weight updates begun anywhere."""

    def __init__(
        self,
        store: Store,
        registry: ModelRegistry,
        info: ReplicaInfo,
        *,
        follow: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._store = store
        self._registry = registry
        self._follow = follow
        self.info = info
        self._last: Mapping[str, Mapping[str, int]] | None = None  # the counts last written
        self._reported_at = float("-inf")
        self._revision = -1
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._failing = False

    async def start(self) -> None:
        await self.report()  # the replica exists from its start: a drain elsewhere waits for its first report
        self._task = asyncio.create_task(self._run(), name="rollway-replica-reporter")

    async def close(self) -> None:
        """Stop reporting and remove this replica's row (its calls have ended: uvicorn stops the application
        after them). A store that cannot take the delete in ``LEAVE_SECONDS`` leaves the row to go stale."""
        self._stopping.set()  # the loop ends at its next turn even if a cancellation is lost on the way
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                async with asyncio.timeout(LEAVE_SECONDS):
                    await self._task
        try:
            await asyncio.wait_for(self._store.leave_replica(self.info.replica_id), LEAVE_SECONDS)
        except Exception as exc:
            log.warning("could not remove this replica's row (%s); others take it for gone later", _reason(exc))

    async def report(self) -> None:
        """Write this process's counts now (taken inside the store's transaction, after the revision)."""
        taken: dict[str, dict[str, int]] = {}

        def snapshot() -> dict[str, dict[str, int]]:
            taken.clear()  # a transaction the store retried takes the counts again
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
            if self._follow is not None:
                await self._follow()

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(TICK):
                    await self._stopping.wait()
            if self._stopping.is_set():
                return
            try:  # bounded: a replica whose report is this late is about to be taken for gone elsewhere
                async with asyncio.timeout(STALE_SECONDS / 2):
                    await self.tick()
            except Exception as exc:  # the store is down or locked for long: keep serving, say so once
                if not self._failing:
                    log.warning("could not report this replica's calls in flight: %s", _reason(exc))
                self._failing = True
            else:
                self._failing = False
