"""Drains that see every replica: each gateway process reports its calls in flight per alias and configuration
(``rollway.app.replicas`` → ``rollway.store.replicas``), and ``ModelRegistry.drain`` waits for the other replicas' calls
too. Two registries (each with its reporter) over one database stand for two gateway processes; the store runs
on both engines."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import Connection, func, select

from rollway.app.replicas import ReplicaReporter, new_replica
from rollway.gateway.errors import AliasPaused
from rollway.gateway.leases import ARRIVING, config_key
from rollway.gateway.registry import ModelRegistry
from rollway.store import Store
from rollway.store.db import models
from rollway.store.replicas import FORGET_SECONDS, STALE_SECONDS
from support.clock import FakeClock

ALIAS = "policy"
BACKEND = {"backend_id": "a", "base_url": "http://127.0.0.1:9/v1", "kind": "vllm", "model": "m"}
B_BACKEND = {**BACKEND, "backend_id": "b"}


def replica(store: Store) -> tuple[ModelRegistry, ReplicaReporter]:
    """One gateway process's registry and reporter (no background loop: the tests call ``tick``)."""
    info = new_replica()
    registry = ModelRegistry(store, replica_id=info.replica_id)
    return registry, ReplicaReporter(store, registry, info)


async def test_a_report_holds_arriving_and_leased_calls_by_configuration(store: Store) -> None:
    v1 = await store.put_model(ALIAS, [BACKEND], version="v1")
    registry, reporter = replica(store)
    arriving = registry.arrival(ALIAS)  # before its arrival transaction: configuration not known yet
    assert registry.snapshot() == {ALIAS: {f"{ARRIVING}-1": 1}}  # it had seen no catalog revision yet
    lease = await registry.admit(ALIAS, 0, arriving)
    assert registry.snapshot() == {ALIAS: {config_key(v1): 1}}
    await reporter.report()
    [seen] = await store.live_replicas()
    assert seen.info == reporter.info and seen.in_flight == {ALIAS: {config_key(v1): 1}}
    assert seen.revision == await store.catalog_revision()
    lease.release()
    assert registry.snapshot() == {}
    await reporter.report()
    assert [r.in_flight for r in await store.live_replicas()] == [{}]
    assert await store.live_replicas(exclude=reporter.info.replica_id) == []
    await reporter.close()
    assert await store.live_replicas() == []  # a replica that stops leaves


async def test_a_call_that_waits_on_a_paused_alias_is_not_counted_while_it_waits(store: Store) -> None:
    await store.put_model(ALIAS, [BACKEND], version="v1")
    registry, _ = replica(store)
    await registry.pause(ALIAS)
    waiting = asyncio.create_task(registry.admit(ALIAS, 30, registry.arrival(ALIAS)))
    await asyncio.sleep(0)  # one turn of the loop: the call runs until it waits for the resume
    assert registry.waiting(ALIAS) == 1
    assert registry.snapshot() == {}  # it will lease what is current at the resume: nothing for a drain
    v2 = await store.put_model(ALIAS, [B_BACKEND], version="v2")
    registry.install(ALIAS, v2)
    await registry.resume(ALIAS)
    lease = await asyncio.wait_for(waiting, 10)
    assert lease.version == "v2" and registry.snapshot() == {ALIAS: {config_key(v2): 1}}
    lease.release()


async def test_a_swap_drain_waits_for_calls_on_earlier_configurations_only(store: Store) -> None:
    await store.put_model(ALIAS, [BACKEND], version="v1")
    registry, _ = replica(store)
    old = await registry.admit(ALIAS, 0)
    v2 = await store.put_model(ALIAS, [B_BACKEND], version="v2")
    registry.install(ALIAS, v2)
    new = await registry.admit(ALIAS, 0)
    assert (old.version, new.version) == ("v1", "v2")
    assert await registry.in_flight_everywhere([v2]) == {ALIAS: (2, 1)}
    assert await registry.drain(ALIAS, 0, old_only=True) is False
    old.release()
    assert await registry.drain(ALIAS, 0, old_only=True) is True  # the call on v2 is not waited for
    assert await registry.drain(ALIAS, 0) is False  # a plain drain waits for every call
    new.release()
    assert await registry.drain(ALIAS, 0) is True


async def test_a_drain_waits_for_another_replicas_calls_until_it_reports_them_ended(store: Store) -> None:
    await store.put_model(ALIAS, [BACKEND], version="v1")
    (trainer, trainer_reporter), (other, other_reporter) = replica(store), replica(store)
    await trainer_reporter.report()
    held = await other.admit(ALIAS, 0)
    await other_reporter.report()
    await trainer.pause(ALIAS)  # through the trainer's replica, while the other one has a call in flight
    assert await trainer.drain(ALIAS, 0) is False
    await other_reporter.tick()  # the catalog moved: it reports, its call counted
    assert await trainer.drain(ALIAS, 0) is False
    assert await trainer.in_flight_everywhere([await store.get_model(ALIAS)]) == {ALIAS: (1, 0)}
    drain = asyncio.create_task(trainer.drain(ALIAS, 30))
    held.release()
    assert await trainer.drain(ALIAS, 0) is False  # ended, but not reported yet
    await other_reporter.tick()  # its counts changed: it reports
    assert await asyncio.wait_for(drain, 10) is True  # the waiting drain sees it on its next read
    assert (await other.state(ALIAS)).paused  # the reporter's revision read reached its registry's cache


async def test_a_drain_waits_for_a_report_written_after_it_began(store: Store) -> None:
    """A replica that has not reported since the pause may hold a call that read the catalog before it."""
    await store.put_model(ALIAS, [BACKEND], version="v1")
    (trainer, _), (_, other_reporter) = replica(store), replica(store)
    await other_reporter.report()  # idle, before the pause
    await trainer.pause(ALIAS)
    assert await trainer.drain(ALIAS, 0) is False  # its last report is older than the pause
    await other_reporter.tick()
    assert await trainer.drain(ALIAS, 0) is True


async def test_an_idle_replica_reports_only_on_change_or_heartbeat(store: Store, clock: FakeClock) -> None:
    await store.put_model(ALIAS, [BACKEND], version="v1")
    registry, reporter = replica(store)
    assert not (await registry.state(ALIAS)).paused  # cached for the registry's TTL
    await reporter.report()
    [first] = await store.live_replicas()
    clock.advance(1)
    await reporter.tick()  # nothing changed, heartbeat not due
    assert [r.reported_time for r in await store.live_replicas()] == [first.reported_time]
    await store.set_model_paused(ALIAS, True)  # a change made elsewhere
    await reporter.tick()
    [second] = await store.live_replicas()
    assert second.reported_time == first.reported_time + 1 and second.revision > first.revision
    assert (await registry.state(ALIAS)).paused  # the reporter observed the revision: reloaded without a call


async def test_replicas_not_heard_from_are_left_out_then_forgotten(store: Store, clock: FakeClock) -> None:
    await store.put_model(ALIAS, [BACKEND], version="v1")
    (gone, gone_reporter), (trainer, trainer_reporter) = replica(store), replica(store)
    await gone.admit(ALIAS, 0)  # never released: the process died with its call
    await gone_reporter.report()
    await trainer.pause(ALIAS)
    clock.advance(STALE_SECONDS + 1)
    await trainer_reporter.report()
    assert [r.info.replica_id for r in await store.live_replicas()] == [trainer_reporter.info.replica_id]
    assert await trainer.drain(ALIAS, 0) is True  # a dead replica's calls are not waited for
    assert await store.read(rows) == 2  # left out, still stored
    clock.advance(FORGET_SECONDS)
    await trainer_reporter.report()  # any report removes rows gone quiet for an hour
    assert await store.read(rows) == 1


def rows(conn: Connection) -> int:
    return int(conn.execute(select(func.count()).select_from(models.gateway_replicas)).scalar_one())


async def test_calls_not_leased_yet_hold_a_drain_only_if_they_arrived_before_it_began(store: Store) -> None:
    """A call that arrived before the replica saw a pause may still lease the old configuration: it holds the
    drain. One that arrived after will see the pause itself: under load there always is one, and it must not
    hold the drain up."""
    await store.put_model(ALIAS, [BACKEND], version="v1")
    (trainer, _), (other, other_reporter) = replica(store), replica(store)
    other.observe(await store.catalog_revision())
    before = other.arrival(ALIAS)  # read the catalog before the pause, no lease yet
    await trainer.pause(ALIAS)
    await other_reporter.report()
    assert await trainer.drain(ALIAS, 0) is False
    other.observe(await store.catalog_revision())  # as its next call's arrival would
    after = other.arrival(ALIAS)
    before.end()
    await other_reporter.report()
    assert await trainer.drain(ALIAS, 0) is True  # ``after`` arrived under the pause's revision
    assert await trainer.in_flight_everywhere([await store.get_model(ALIAS)]) == {ALIAS: (1, 0)}
    after.end()


async def test_a_drain_counts_its_own_processs_calls_that_arrived_before_it_saw_the_change(store: Store) -> None:
    """Paused through one replica, drained through another (a load balancer in front of the admin API): the
    draining replica's own call that read the catalog before the pause is waited for, and the drain makes the
    replica see the pause, so its next calls wait."""
    await store.put_model(ALIAS, [BACKEND], version="v1")
    (trainer, _), (other, _) = replica(store), replica(store)
    other.observe(await store.catalog_revision())
    assert not (await other.state(ALIAS)).paused  # cached
    racing = other.arrival(ALIAS)
    await trainer.pause(ALIAS)
    assert await other.drain(ALIAS, 0) is False  # its cached copy says running: the call could lease v1
    with pytest.raises(AliasPaused):  # the drain made the replica see the pause: the call waits instead
        await other.admit(ALIAS, 0, racing)
    assert await other.drain(ALIAS, 0) is True


async def test_concurrent_drains_each_see_a_call_end(store: Store) -> None:
    await store.put_model(ALIAS, [BACKEND], version="v1")
    registry, _ = replica(store)
    lease = await registry.admit(ALIAS, 0)
    drains = [asyncio.create_task(registry.drain(ALIAS, 60)) for _ in range(3)]
    await asyncio.sleep(0)
    lease.release()
    assert await asyncio.wait_for(asyncio.gather(*drains), 5) == [True, True, True]
