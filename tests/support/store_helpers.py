"""Small builders shared by the store contract tests."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TypeVar

from rollway.store import Store, TaskSpec

if TYPE_CHECKING:
    import asyncpg

_span_ids = itertools.count(1)
T = TypeVar("T")


def span(rollout_id: str | None, attempt_id: str | None = None, **fields: Any) -> dict[str, Any]:
    """A minimal span for ``rollout_id``/``attempt_id`` with a fresh span id."""
    n = next(_span_ids)
    return {
        "rollout_id": rollout_id,
        "attempt_id": attempt_id,
        "trace_id": f"trace-{n:08d}",
        "span_id": f"span-{n:08d}",
        "name": "llm.call",
        **fields,
    }


def filled(values: Iterable[T | None]) -> list[T]:
    """``values`` as a list, each asserted to be set: fields the store fills in (a group index, a sequence id) are
    optional in its models."""
    checked: list[T] = []
    for value in values:
        assert value is not None, "a value the store fills in is missing"
        checked.append(value)
    return checked


async def enqueue_one(store: Store, **task: Any) -> str:
    [rollout] = await store.enqueue([TaskSpec(**task)])
    return rollout.rollout_id


async def waiting_for_a_lock(conn: asyncpg.Connection) -> bool:
    """Whether another session of ``conn``'s database waits for a lock (PostgreSQL). The statistics snapshot is
    dropped first: inside a transaction the server keeps answering from the first one it read."""
    await conn.execute("SELECT pg_stat_clear_snapshot()")
    query = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
    return bool(await conn.fetchval(query))
