"""The alias registry across replicas: two ``ModelRegistry`` objects over one database stand for two gateway
processes sharing it (each caches the alias for its TTL)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.registry import AliasPaused, ModelRegistry
from store import Store

ALIAS = "policy"
BACKEND = {"backend_id": "a", "base_url": "http://127.0.0.1:9/v1", "kind": "vllm", "model": "m"}


async def test_a_call_waiting_on_a_paused_alias_wakes_when_another_replica_resumes_it(store: Store) -> None:
    await store.put_model(ALIAS, [BACKEND], version="v1")
    trainer, replica = ModelRegistry(store, ttl=0.05), ModelRegistry(store, ttl=0.05)
    await trainer.pause(ALIAS)
    assert (await replica.state(ALIAS)).paused  # the replica has loaded it paused
    waiting = asyncio.create_task(replica.admit(ALIAS, wait_seconds=30))
    await trainer.resume(ALIAS)
    # Nothing in the replica's process resumed it: it sees the resume when it reloads the alias, not after the
    # 30 s its caller may wait.
    lease = await asyncio.wait_for(waiting, 10)
    assert lease.version == "v1" and replica.in_flight(ALIAS) == 1
    lease.release()


async def test_a_swap_in_one_replica_reaches_the_others_calls_within_the_ttl(store: Store) -> None:
    await store.put_model(ALIAS, [BACKEND], version="v1")
    trainer, replica = ModelRegistry(store, ttl=0.05), ModelRegistry(store, ttl=0.05)
    held = await replica.admit(ALIAS, wait_seconds=0)
    swapped = await store.put_model(ALIAS, [{**BACKEND, "backend_id": "b"}], version="v2")
    await trainer.swap(ALIAS, swapped)
    await trainer.pause(ALIAS)
    with pytest.raises(AliasPaused):
        await trainer.admit(ALIAS, wait_seconds=0)
    replica.invalidate(ALIAS)  # what its TTL running out does
    with pytest.raises(AliasPaused):
        await replica.admit(ALIAS, wait_seconds=0)
    await trainer.resume(ALIAS)
    replica.invalidate(ALIAS)
    later = await replica.admit(ALIAS, wait_seconds=0)
    assert (held.version, later.version) == ("v1", "v2")  # the call in flight keeps its configuration
    assert [b.backend_id for b in later.config.backends] == ["b"]
