"""The alias registry across replicas: two ``ModelRegistry`` objects over one database stand for two gateway
processes sharing it. Each caches the alias for its TTL; the replica's clock here only moves when the test
moves it, so what it has cached stays until then."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rollway.gateway.errors import AliasPaused, UnknownAlias
from rollway.gateway.registry import ModelRegistry
from rollway.store import Store

ALIAS = "policy"
BACKEND = {"backend_id": "a", "base_url": "http://127.0.0.1:9/v1", "kind": "vllm", "model": "m"}
TTL = 0.05


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_a_call_waiting_on_a_paused_alias_wakes_when_another_replica_resumes_it(store: Store) -> None:
    await store.put_model(ALIAS, [BACKEND], version="v1")
    clock = Clock()
    trainer, replica = ModelRegistry(store, ttl=TTL), ModelRegistry(store, ttl=TTL, clock=clock)
    await trainer.pause(ALIAS)
    assert (await replica.state(ALIAS)).paused  # loaded, and cached: the replica's clock never moves
    waiting = asyncio.create_task(replica.admit(ALIAS, wait_seconds=30))
    await asyncio.sleep(0)  # one turn of the loop: the call runs until it waits for the resume
    assert replica.waiting(ALIAS) == 1
    await trainer.resume(ALIAS)
    # Nothing in the replica's process resumed the alias and its cached copy never expires here: the call sees
    # the resume through the catalog revision it asks the store for while it waits, not after its 30 s.
    lease = await asyncio.wait_for(waiting, 10)
    assert lease.version == "v1" and replica.in_flight(ALIAS) == 1 and replica.waiting(ALIAS) == 0
    lease.release()


class GatedStore:
    """The store, except that ``get_model`` reads, then waits for ``gate`` before it answers: a reload caught
    between its read and its install."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.gate = asyncio.Event()
        self.reading = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def get_model(self, alias: str) -> Any:
        config = await self.store.get_model(alias)
        self.reading.set()
        await self.gate.wait()
        return config


async def test_a_reload_that_read_before_a_change_is_done_again_not_installed(store: Store) -> None:
    await store.put_model(ALIAS, [BACKEND], version="v1")
    gated = GatedStore(store)
    replica = ModelRegistry(gated, ttl=TTL, clock=Clock())  # type: ignore[arg-type]
    reload = asyncio.create_task(replica.state(ALIAS))  # reads v1, then waits at the gate
    await gated.reading.wait()
    await store.put_model(ALIAS, [{**BACKEND, "backend_id": "b"}], version="v2")  # through another replica
    assert replica.observe(await store.catalog_revision())  # a later call's arrival sees the swap
    gated.gate.set()
    assert (await asyncio.wait_for(reload, 10)).config.version == "v2"  # read again: v1 is never installed
    assert (await replica.admit(ALIAS, wait_seconds=0)).version == "v2"


async def test_a_waiting_call_gives_up_at_its_bound_while_the_alias_stays_paused(store: Store) -> None:
    await store.put_model(ALIAS, [BACKEND], version="v1")
    registry = ModelRegistry(store, ttl=TTL)
    await registry.pause(ALIAS)
    with pytest.raises(AliasPaused) as info:
        await registry.admit(ALIAS, wait_seconds=3 * TTL)  # re-reads it a few times, still paused
    assert info.value.retry_after >= 1.0 and registry.waiting(ALIAS) == 0 and registry.in_flight(ALIAS) == 0


async def test_a_swap_made_through_one_replica_reaches_the_others_new_calls_once_it_reloads(store: Store) -> None:
    await store.put_model(ALIAS, [BACKEND], version="v1")
    clock = Clock()
    trainer, replica = ModelRegistry(store, ttl=TTL), ModelRegistry(store, ttl=TTL, clock=clock)
    held = await replica.admit(ALIAS, wait_seconds=0)
    swapped = await store.put_model(ALIAS, [{**BACKEND, "backend_id": "b"}], version="v2")
    trainer.install(ALIAS, swapped)
    cached = await replica.admit(ALIAS, wait_seconds=0)
    clock.now += 2 * TTL
    later = await replica.admit(ALIAS, wait_seconds=0)
    # The call in flight keeps its configuration; within the TTL the replica still serves v1.
    assert (held.version, cached.version, later.version) == ("v1", "v1", "v2")
    assert [b.backend_id for b in later.config.backends] == ["b"]


async def test_a_new_catalog_revision_makes_a_replica_reload_before_its_next_call(store: Store) -> None:
    await store.put_model(ALIAS, [BACKEND], version="v1")
    clock = Clock()
    trainer, replica = ModelRegistry(store, ttl=TTL), ModelRegistry(store, ttl=TTL, clock=clock)
    told: list[str] = []
    replica.listen(lambda: told.append("changed"))
    first = await store.catalog_revision()
    assert replica.observe(first)  # the first revision it sees
    (await replica.admit(ALIAS, wait_seconds=0)).release()  # cached: v1, and the clock never moves
    swapped = await store.put_model(ALIAS, [{**BACKEND, "backend_id": "b"}], version="v2")
    trainer.install(ALIAS, swapped)
    assert not replica.observe(first)  # the revision it saw: nothing new, the cache stays
    assert (await replica.admit(ALIAS, wait_seconds=0)).version == "v1"
    assert replica.observe(await store.catalog_revision())  # as a call's arrival would read it
    later = await replica.admit(ALIAS, wait_seconds=0)
    assert (later.version, [b.backend_id for b in later.config.backends]) == ("v2", ["b"])
    assert told == ["changed", "changed"]
    assert not replica.observe(await store.catalog_revision())  # seen already: the cache stays


async def test_names_of_unknown_aliases_leave_nothing_behind(store: Store) -> None:
    """A call naming a model that does not exist is a 404; the name (any string a client sends) must not stay in
    the registry, or every distinct wrong name grows the process (it kept a lock per name)."""
    await store.put_model(ALIAS, [BACKEND], version="v1")
    registry = ModelRegistry(store, ttl=TTL)
    await registry.state(ALIAS)
    for i in range(50):
        with pytest.raises(UnknownAlias):
            await registry.state(f"no-such-model-{i}")
    assert set(registry._locks) == set(registry._states) == {ALIAS}
    await store.delete_model(ALIAS)
    registry.invalidate(ALIAS)
    with pytest.raises(UnknownAlias):
        await registry.state(ALIAS)
    assert registry._locks == {} and registry._states == {}
