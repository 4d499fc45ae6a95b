"""Schema management (docs/store.md): a store opened on an empty or older database creates or upgrades the
schema with Alembic, keeps the data, and does nothing to a database that is already at head."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, Engine, event, inspect
from sqlalchemy.ext.asyncio import AsyncEngine

from rollway.store import ConflictError, RolloutStatus, Store
from rollway.store.db import migrate, models
from rollway.store.db.engine import create_engines, migration_engine

HEAD_TABLES = {
    "alembic_version",
    "rollouts",
    "attempts",
    "spans",
    "span_sequences",
    "resources",
    "counters",
    "model_aliases",
    "api_keys",
    "workers",
    "agent_servers",
    "gateway_replicas",
    "weight_updates",
}
ADDED_AFTER_0001 = {"model_aliases", "api_keys", "workers", "agent_servers", "gateway_replicas", "weight_updates"}


async def _run(engine: AsyncEngine | Engine, fn: Callable[[Connection], Any], *, write: bool = False) -> Any:
    """Run ``fn`` on a sync connection of either kind of engine (in a transaction when ``write``)."""
    if isinstance(engine, AsyncEngine):
        async with engine.begin() if write else engine.connect() as conn:
            return await conn.run_sync(fn)

    def run() -> Any:
        with engine.begin() if write else engine.connect() as conn:
            return fn(conn)

    return await asyncio.to_thread(run)


async def _tables(engine: AsyncEngine | Engine) -> set[str]:
    return set(await _run(engine, lambda sync: inspect(sync).get_table_names()))


@pytest.fixture
def statements() -> Iterator[list[str]]:
    """Every SQL statement any engine executes while the fixture is active."""
    seen: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        seen.append(statement)

    event.listen(Engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(Engine, "before_cursor_execute", record)


def test_head_is_past_the_first_revision() -> None:
    assert migrate.head_revision() not in (None, "0001")


async def test_an_empty_database_is_created_at_head(store_url: str) -> None:
    async with await Store.open(store_url, run_watchdog=False) as store:
        assert await migrate.current_revision(store.engines.primary) == migrate.head_revision()
        assert await _tables(store.engines.primary) >= HEAD_TABLES
        [rollout] = await store.enqueue([{"input": {"q": 1}}])
        [claimed] = await store.claim("w1")
        assert claimed.rollout.rollout_id == rollout.rollout_id


async def test_a_database_at_0001_is_upgraded_with_its_data(store_url: str) -> None:
    engines = create_engines(store_url)
    target = engines.pg if engines.pg is not None else migration_engine(store_url)
    try:
        await migrate.upgrade(target, "0001")
        assert await migrate.current_revision(target) == "0001"
        assert ADDED_AFTER_0001.isdisjoint(await _tables(target))
        await _run(
            target,
            lambda conn: conn.execute(
                models.rollouts.insert().values(
                    rollout_id="ro-old",
                    input={"prompt": "kept", "n": [1, 2, 3]},
                    mode="train",
                    status="queuing",
                    config={"max_attempts": 2, "retry_condition": ["failed"]},
                    metadata={"origin": "0001"},
                    priority=3,
                    start_time=1_700_000_000.0,
                    queue_time=1_700_000_000.0,
                    attempt_count=0,
                    updated_time=1_700_000_000.0,
                )
            ),
            write=True,
        )
    finally:
        if isinstance(target, Engine):
            target.dispose()
        await engines.dispose()

    async with await Store.open(store_url, run_watchdog=False) as store:
        assert await migrate.current_revision(store.engines.primary) == migrate.head_revision()
        assert await _tables(store.engines.primary) >= HEAD_TABLES

        old = await store.get_rollout("ro-old")
        assert old.input == {"prompt": "kept", "n": [1, 2, 3]}
        assert old.metadata == {"origin": "0001"}
        assert old.config.max_attempts == 2
        assert old.priority == 3
        assert old.status == RolloutStatus.QUEUING

        # The old row goes through today's queue, and the new tables work.
        [claimed] = await store.claim("worker-after-upgrade")
        assert claimed.rollout.rollout_id == "ro-old"
        assert [w.worker_id for w in await store.list_workers()] == ["worker-after-upgrade"]
        alias = await store.put_model("policy", [{"base_url": "http://127.0.0.1:9/v1", "model": "tiny"}], version="v1")
        assert (await store.get_model("policy")).version == alias.version == "v1"
        key, plain = await store.mint_key("admin", name="after-upgrade")
        found = await store.find_key(plain)
        assert found is not None and found.key_id == key.key_id


def _downgrade(conn: Connection, revision: str) -> None:
    config = Config()
    config.set_main_option("script_location", str(migrate.MIGRATIONS))
    config.attributes["connection"] = conn
    command.downgrade(config, revision)


async def test_keyed_rows_written_before_0005_are_recognised_by_what_they_hold(store_url: str) -> None:
    """Rows from before migration 0005 keep no digest of the keyed request that made them: the request sent again
    after the upgrade is compared with their columns, as it was then."""
    async with await Store.open(store_url, run_watchdog=False) as store:
        queued = await store.enqueue([{"input": 1, "metadata": {"m": 1}}], idempotency_key="k")
        started = await store.start_rollout({"input": 2}, "w1", idempotency_key="s")
        rid = started.rollout.rollout_id
        attempt = await store.start_attempt(rid, "w1", idempotency_key="a")
        [claimed] = await store.claim("w1", idempotency_key="c")
    engines = create_engines(store_url)
    target = engines.pg if engines.pg is not None else migration_engine(store_url)
    try:
        await _run(target, lambda conn: _downgrade(conn, "0004"), write=True)
        assert await migrate.current_revision(target) == "0004"
    finally:
        if isinstance(target, Engine):
            target.dispose()
        await engines.dispose()

    async with await Store.open(store_url, run_watchdog=False) as store:
        assert [
            r.rollout_id for r in await store.enqueue([{"input": 1, "metadata": {"m": 1}}], idempotency_key="k")
        ] == [queued[0].rollout_id]
        assert (await store.start_rollout({"input": 2}, "w1", idempotency_key="s")).rollout.rollout_id == rid
        assert (await store.start_attempt(rid, "w1", idempotency_key="a")).attempt == attempt.attempt
        assert [c.attempt.attempt_id for c in await store.claim("w1", idempotency_key="c")] == [
            claimed.attempt.attempt_id
        ]
        refused: list[Callable[[], Awaitable[Any]]] = [
            lambda: store.enqueue([{"input": 1, "metadata": {"m": 2}}], idempotency_key="k"),
            lambda: store.start_rollout({"input": 2}, "w2", idempotency_key="s"),
            lambda: store.start_attempt(rid, "w2", idempotency_key="a"),
            lambda: store.claim("w2", idempotency_key="c"),
        ]
        for call in refused:
            with pytest.raises(ConflictError):
                await call()


async def test_reopening_a_database_at_head_changes_nothing(store_url: str, statements: list[str]) -> None:
    async with await Store.open(store_url, run_watchdog=False) as store:
        [rollout] = await store.enqueue([{"input": "kept", "rollout_id": "ro-1"}])
        tables = await _tables(store.engines.primary)

    statements.clear()
    async with await Store.open(store_url, run_watchdog=False) as store:
        during_open = list(statements)
        assert await migrate.current_revision(store.engines.primary) == migrate.head_revision()
        assert await _tables(store.engines.primary) == tables
        assert (await store.get_rollout("ro-1")).input == rollout.input

    assert any("alembic_version" in s for s in during_open), "the open did not check the schema revision"
    changes = [
        s
        for s in during_open
        if s.lstrip().split(None, 1)[0].upper() in {"CREATE", "ALTER", "DROP", "INSERT", "UPDATE", "DELETE"}
    ]
    assert changes == []


async def test_stores_opening_an_empty_database_together_migrate_it_once(store_url: str) -> None:
    opened = await asyncio.gather(*(Store.open(store_url, run_watchdog=False) for _ in range(3)))
    try:
        for store in opened:
            assert await migrate.current_revision(store.engines.primary) == migrate.head_revision()
        await opened[0].enqueue([{"input": "x", "rollout_id": "ro-shared"}])
        assert (await opened[2].get_rollout("ro-shared")).input == "x"
    finally:
        for store in opened:
            await store.close()
