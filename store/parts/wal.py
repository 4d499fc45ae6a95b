"""The SQLite write-ahead log part of ``Store``: checkpoints, in a worker thread, once a second after writes."""

from __future__ import annotations

import asyncio
import logging

from sqlalchemy import Engine

from rollway.store.db.engine import Engines, WalKeeper
from rollway.store.db.faults import FailureLog
from rollway.store.db.writer import BatchWriter, Writer

log = logging.getLogger("rollway.store")

CHECKPOINT_INTERVAL = 1.0


class WalMixin:
    engines: Engines
    writer: Writer
    failures: FailureLog
    _checkpointed_at: int = 0  # the writer's transaction count at the last checkpoint
    _wal: WalKeeper | None = None
    _checkpointing: asyncio.Lock | None = None  # one checkpoint at a time: the loop's, an explicit one

    async def checkpoint(self) -> None:
        """SQLite: copy the write-ahead log into the database file, in a worker thread (the writer's own
        automatic checkpoints are off so that their fsync never stalls the event loop); a long log is also
        emptied, with this process's writer paused (``store.db.engine.WalKeeper`` says why and how)."""
        reader = self.engines.reader
        if reader is None:
            return
        if self._checkpointing is None:
            self._checkpointing = asyncio.Lock()
        # Two checkpoints side by side would make the one emptying the log wait for the other's copy, give up as
        # if a reader stayed, and back off for a second while the log grows.
        async with self._checkpointing:
            await self._checkpoint(reader)

    async def _checkpoint(self, reader: Engine) -> None:
        self._checkpointed_at = self.writer.stats.transactions
        if self._wal is None:
            self._wal = WalKeeper(reader)
        if await asyncio.to_thread(self._wal.passive) and isinstance(self.writer, BatchWriter):
            async with self.writer.paused():  # this process's writes wait: the lock is the checkpoint's
                truncating = asyncio.ensure_future(asyncio.to_thread(self._wal.truncate))
                try:
                    await asyncio.shield(truncating)
                except asyncio.CancelledError:  # (closing) the thread holds the write lock: let it finish first
                    await truncating
                    raise

    async def _checkpoint_loop(self) -> None:
        while True:
            await asyncio.sleep(CHECKPOINT_INTERVAL)
            if self.writer.stats.transactions == self._checkpointed_at:
                continue
            try:
                await self.checkpoint()
            except Exception as exc:  # a full disk: once a second, every second, without the interval
                self.failures.log(log, "checkpoint", "WAL checkpoint failed", exc_info=exc)
