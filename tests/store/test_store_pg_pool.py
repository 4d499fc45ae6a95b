"""The PostgreSQL pool's size (``ROLLWAY_PG_POOL_SIZE``, ``Store.open(pg_pool_size=)``): a process never holds
more server connections than it, and writes beyond it wait for a connection instead of failing."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from rollway.settings import Settings
from rollway.store import Store
from rollway.store.db.engine import PG_POOL_SIZE
from support.postgres import PG_ADMIN_URL

pytestmark = pytest.mark.postgres


async def _connections(database: str) -> int:
    conn = await asyncpg.connect(PG_ADMIN_URL, timeout=3)
    try:
        count: int = await conn.fetchval("SELECT count(*) FROM pg_stat_activity WHERE datname = $1", database)
        return count
    finally:
        await conn.close()


async def test_a_process_keeps_at_most_its_pool_size_of_connections(pg_url: str) -> None:
    database = pg_url.rpartition("/")[2]
    store = await Store.open(pg_url, run_watchdog=False, keepalive_interval=0, pg_pool_size=2)
    try:
        held: list[int] = []
        stop = asyncio.Event()

        async def watch() -> None:
            while not stop.is_set():
                held.append(await _connections(database))
                await asyncio.sleep(0.01)  # a sampling period, not a synchronisation

        watcher = asyncio.create_task(watch())
        # Forty writes at once, twenty times the pool: each waits its turn for a connection.
        results = await asyncio.gather(*(store.enqueue([{"input": {"n": n}}]) for n in range(40)))
        stop.set()
        await watcher
        held.append(await _connections(database))
        assert len({r[0].rollout_id for r in results}) == 40
        assert max(held) <= 2, held
        assert held[-1] >= 1  # the pool keeps its connections open between writes
    finally:
        await store.close()


def test_the_pool_size_is_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().pg_pool_size == PG_POOL_SIZE  # the store's own default
    monkeypatch.setenv("ROLLWAY_PG_POOL_SIZE", "5")
    assert Settings().pg_pool_size == 5
    monkeypatch.setenv("ROLLWAY_PG_POOL_SIZE", "0")
    with pytest.raises(ValueError, match="pg_pool_size"):
        Settings()
