"""Concurrency contracts of the store (docs/store.md): an atomic claim across OS processes, gap-free span
sequence ids under concurrent writes, SQLite group commit, and the watchdog's cross-process debounce."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from sqlalchemy import select

from rollway.store import AgentServer, AttemptStatus, ConflictError, RolloutStatus, Store, StoreValidationError
from rollway.store.controlled import ControlledCreate, ControlledPatch, EngineModel, backends_of
from rollway.store.db import models
from rollway.store.sql import watchdog
from support.claiming import claim_process
from support.store_helpers import filled

if TYPE_CHECKING:
    from support.clock import FakeClock

PROCESSES = 4
ROLLOUTS = 1_000
JOIN_TIMEOUT = 90.0


# -- 4 processes x 8 tasks claiming from one queue --------------------------------------------------------


@pytest.mark.slow
async def test_claims_across_processes_hand_each_rollout_to_exactly_one_worker(store_url: str, tmp_path: Path) -> None:
    async with await Store.open(store_url, run_watchdog=False) as store:
        enqueued = await store.enqueue([{"input": {"n": i}} for i in range(ROLLOUTS)])
    expected = {r.rollout_id for r in enqueued}
    assert len(expected) == ROLLOUTS

    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(PROCESSES)
    outputs = [tmp_path / f"claims-{i}.json" for i in range(PROCESSES)]
    procs = [
        ctx.Process(target=claim_process, args=(store_url, i, start, str(outputs[i])), daemon=True)
        for i in range(PROCESSES)
    ]
    try:
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + JOIN_TIMEOUT  # one deadline for all, not one per process
        for proc in procs:
            await asyncio.to_thread(proc.join, max(0.0, deadline - time.monotonic()))
        assert [p.exitcode for p in procs] == [0] * PROCESSES, "a claiming process failed or hung"
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
            proc.close()

    claims: list[tuple[str, str, str]] = []
    per_process: list[int] = []
    for path in outputs:
        rows = [tuple(row) for row in json.loads(path.read_text())]
        per_process.append(len(rows))
        claims.extend(rows)
    handed_out = Counter(rollout_id for rollout_id, _, _ in claims)
    duplicates = {rid: n for rid, n in handed_out.items() if n > 1}
    assert duplicates == {}, f"rollouts handed to more than one worker: {list(duplicates)[:5]}"
    assert set(handed_out) == expected
    assert len(claims) == ROLLOUTS
    if not store_url.startswith("sqlite"):
        # SKIP LOCKED lets the processes claim side by side. (On SQLite the file lock is not fair: the
        # process that holds it often re-takes it before the others' busy handlers retry, so one process
        # may claim most or all rollouts; what matters there is that none is claimed twice.)
        assert sum(1 for n in per_process if n) >= 2, per_process

    async with await Store.open(store_url, run_watchdog=False) as store:
        stats = await store.stats()
        assert stats.rollouts_by_status[RolloutStatus.PREPARING.value] == ROLLOUTS
        assert stats.queue_depth == 0
        assert stats.total_attempts == ROLLOUTS
        a = models.attempts
        stored = await store.read(
            lambda conn: conn.execute(select(a.c.rollout_id, a.c.attempt_id, a.c.worker_id)).all()
        )
    # The database agrees with what the workers were told: one attempt per rollout, for that worker.
    assert {(r.rollout_id, r.worker_id, r.attempt_id) for r in stored} == set(claims)


# -- span sequence ids ---------------------------------------------------------------------------------------


def _span(rollout_id: str, attempt_id: str, n: int, **extra: Any) -> dict[str, Any]:
    return {
        "rollout_id": rollout_id,
        "attempt_id": attempt_id,
        "trace_id": f"trace-{rollout_id}",
        "span_id": f"span-{n:05d}",
        "name": "chat.completions",
        **extra,
    }


async def test_concurrent_span_writes_get_sequence_ids_one_to_n(store: Store, migrated_url: str) -> None:
    started = await store.start_rollout({"input": "x"}, worker_id="w")
    rid, aid = started.rollout.rollout_id, started.attempt.attempt_id

    written = await asyncio.gather(*(store.add_span(_span(rid, aid, n)) for n in range(200)))

    seqs = filled(s.sequence_id for s in written if s is not None)
    assert sorted(seqs) == list(range(1, 201))
    stored = await store.query_spans(rid, aid)
    assert [s.sequence_id for s in stored] == list(range(1, 201))
    assert len({s.span_id for s in stored}) == 200
    if migrated_url.startswith("sqlite"):
        # One writer, one queue: the store numbers calls in the order they reached it.
        assert seqs == list(range(1, 201))
    attempt = await store.get_attempt(rid, aid)
    assert attempt.status == AttemptStatus.RUNNING
    # The counter continues after the burst.
    assert (await store.allocate_sequence(rid, aid))[1] == 201


async def test_concurrent_sequence_allocations_are_gap_free(store: Store) -> None:
    started = await store.start_rollout({"input": "x"})
    rid, aid = started.rollout.rollout_id, started.attempt.attempt_id

    allocated = await asyncio.gather(*(store.allocate_sequence(rid, "latest") for _ in range(200)))

    assert {attempt for attempt, _ in allocated} == {aid}
    assert sorted(first for _, first in allocated) == list(range(1, 201))
    # Multi-id reservations interleaved with single ones also tile the range without gaps or overlaps.
    ranges = await asyncio.gather(*(store.allocate_sequence(rid, aid, count=1 + i % 4) for i in range(40)))
    ids = sorted(first + k for i, (_, first) in enumerate(ranges) for k in range(1 + i % 4))
    assert ids == list(range(201, 201 + sum(1 + i % 4 for i in range(40))))


async def test_sqlite_group_commit_batches_a_burst_of_writes(tmp_path: Path, clock: FakeClock) -> None:
    async with await Store.open(f"sqlite:///{tmp_path / 'g.db'}", clock=clock, run_watchdog=False) as store:
        started = await store.start_rollout({"input": "x"})
        rid, aid = started.rollout.rollout_id, started.attempt.attempt_id
        before = store.writer.stats.transactions
        ops_before = store.writer.stats.operations

        written = await asyncio.gather(*(store.add_span(_span(rid, aid, n)) for n in range(500)))

        transactions = store.writer.stats.transactions - before
        assert store.writer.stats.operations - ops_before == 500
        assert all(s is not None for s in written)
        assert transactions <= 500 // 20, f"500 writes took {transactions} transactions"
        assert max(store.writer.stats.batch_sizes) > 1
        assert len(await store.query_spans(rid, aid)) == 500


# -- the watchdog debounce across stores -------------------------------------------------------------------


@pytest.fixture
async def two_stores(store_url: str, clock: FakeClock) -> AsyncIterator[tuple[Store, Store]]:
    """Two stores (as two gateway processes would open) on one database, one clock, interval 10 s."""
    first = await Store.open(store_url, clock=clock, watchdog_interval=10.0, run_watchdog=False)
    try:
        second = await Store.open(store_url, clock=clock, watchdog_interval=10.0, run_watchdog=False)
        try:
            yield first, second
        finally:
            await second.close()
    finally:
        await first.close()


@pytest.fixture
def sweeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Records the time of every sweep that actually ran (won its turn, or was forced)."""
    ran: list[float] = []
    real: Callable[..., int] = watchdog.sweep

    def counting(conn: Any, now: float) -> int:
        ran.append(now)
        return real(conn, now)

    monkeypatch.setattr(watchdog, "sweep", counting)
    return ran


async def _overdue_attempt(store: Store, clock: FakeClock) -> tuple[str, str]:
    started = await store.start_rollout({"input": "x", "config": {"timeout_seconds": 5}})
    clock.advance(6)
    return started.rollout.rollout_id, started.attempt.attempt_id


async def test_concurrent_sweeps_of_two_stores_take_one_turn(
    two_stores: tuple[Store, Store], clock: FakeClock, sweeps: list[float]
) -> None:
    first, second = two_stores
    rid, aid = await _overdue_attempt(first, clock)

    results = await asyncio.gather(first.sweep(), second.sweep(), first.sweep(), second.sweep())

    assert len(sweeps) == 1, "more than one store swept within one interval"
    assert sorted(results) == [0, 0, 0, 1]
    assert (await second.get_attempt(rid, aid)).status == AttemptStatus.TIMEOUT


async def test_sweep_is_debounced_until_the_interval_passes(
    two_stores: tuple[Store, Store], clock: FakeClock, sweeps: list[float]
) -> None:
    first, second = two_stores
    assert await first.sweep() == 0  # takes the turn (nothing to do yet)
    assert len(sweeps) == 1

    rid, aid = await _overdue_attempt(first, clock)  # 6 s later: still within the 10 s interval
    assert await second.sweep() == 0
    assert await first.sweep() == 0
    assert len(sweeps) == 1
    assert (await first.get_attempt(rid, aid)).status == AttemptStatus.PREPARING

    clock.advance(5)  # 11 s after the last sweep: the next caller, whichever store, sweeps
    assert await second.sweep() == 1
    assert await first.sweep() == 0
    assert len(sweeps) == 2
    assert (await first.get_attempt(rid, aid)).status == AttemptStatus.TIMEOUT


async def test_forced_sweep_ignores_the_debounce(
    two_stores: tuple[Store, Store], clock: FakeClock, sweeps: list[float]
) -> None:
    first, second = two_stores
    assert await first.sweep() == 0
    rid, aid = await _overdue_attempt(first, clock)
    assert await second.sweep() == 0
    assert await second.sweep(force=True) == 1
    assert len(sweeps) == 2
    assert (await first.get_attempt(rid, aid)).status == AttemptStatus.TIMEOUT


async def test_two_stores_joining_one_group_at_once_give_each_member_its_own_index(
    two_stores: tuple[Store, Store],
) -> None:
    """Tasks naming a group join it (indexes continue after its members): two replicas joining at the same
    moment take turns, so no index is given twice and the size counts every member."""
    first, second = two_stores
    for round_ in range(10):
        group = f"g{round_}"
        await asyncio.gather(
            first.enqueue([{"input": 1, "group_id": group}, {"input": 2, "group_id": group}]),
            second.enqueue([{"input": 3, "group_id": group}, {"input": 4, "group_id": group}]),
        )
        members = await first.get_group(group)
        assert sorted(filled(r.group_index for r in members)) == [0, 1, 2, 3]
        assert max(r.group_size or 0 for r in members) == 4


async def test_two_stores_starting_members_of_one_declared_group_at_once_never_overfill_it(
    two_stores: tuple[Store, Store],
) -> None:
    """Direct starts declaring a group of 3, five at once from two replicas: three get the places 0..2, the
    others are refused (the group is full), never a fourth member or an index given twice."""
    first, second = two_stores
    for round_ in range(5):
        group = f"d{round_}"
        task = {"input": round_, "group_id": group, "group_size": 3}
        tries = await asyncio.gather(
            *(store.start_rollout(task, f"w{i}") for i, store in enumerate([first, second] * 2 + [first])),
            return_exceptions=True,
        )
        refused = [t for t in tries if isinstance(t, Exception)]
        assert len(refused) == 2 and all(isinstance(e, StoreValidationError) for e in refused), refused
        members = await second.get_group(group)
        assert sorted((r.group_index, r.group_size) for r in members) == [(0, 3), (1, 3), (2, 3)]


async def test_two_stores_writing_one_named_thing_at_once_take_turns(two_stores: tuple[Store, Store]) -> None:
    """A new version of one resources bundle, a PUT of one model alias, a PUT of one agent server: each reads what
    is stored, then inserts or replaces it. Sent at once through two replicas they take turns, as SQLite's single
    writer makes them — none is refused because another's insert won the race (PostgreSQL answered 409 'duplicate
    key' to all but one of them), and each update of a bundle or an alias gets its own version."""
    first, second = two_stores
    replicas = [first, second] * 3
    bundle = await first.add_resources({"llm": {"endpoint": "v1"}})
    updated = await asyncio.gather(
        *(
            store.update_resources(bundle.resources_id, {"llm": {"endpoint": str(i)}})
            for i, store in enumerate(replicas)
        )
    )
    assert sorted(u.version for u in updated) == [2, 3, 4, 5, 6, 7]
    new = await asyncio.gather(*(store.update_resources("fresh", {"p": i}) for i, store in enumerate(replicas)))
    assert sorted(u.version for u in new) == [1, 2, 3, 4, 5, 6]
    backend = {"base_url": "http://127.0.0.1:9/v1", "kind": "openai", "model": "m"}
    models_ = await asyncio.gather(*(store.put_model("policy", [backend]) for store in replicas))
    assert sorted(int(m.version or 0) for m in models_) == [1, 2, 3, 4, 5, 6]
    server = AgentServer(name="agents", url="http://127.0.0.1:9")
    await asyncio.gather(*(store.put_agent(server) for store in replicas))
    assert [a.name for a in await second.list_agents()] == ["agents"]


async def test_events_posted_at_once_before_a_controlled_rollout_starts_are_all_kept(
    two_stores: tuple[Store, Store],
) -> None:
    """Events an agent posts before the controller starts its rollout wait in the rollout's row: posted at once
    through two replicas, each one is kept (each post locks the row before it reads it)."""
    first, second = two_stores
    [made] = await first.create_controlled([ControlledCreate(rollout_id="early", input=1)])
    assert made.state == "queuing"
    await asyncio.gather(
        *(store.add_controlled_event("early", "0", "note", {"n": n}) for n, store in enumerate([first, second] * 20))
    )
    record, _ = await second.get_controlled("early")
    assert sorted(e["data"]["n"] for e in record.early_events) == list(range(40))


async def test_a_controlled_rollout_started_twice_at_once_starts_once(two_stores: tuple[Store, Store]) -> None:
    """Two controllers (or a controller's retry) moving one queued rollout to running at once through two replicas:
    one change is applied and the other is refused by the transition table, so the rollout has one attempt."""
    first, second = two_stores
    await first.create_controlled([ControlledCreate(rollout_id=f"twice-{n}", input=n) for n in range(10)])
    for n in range(10):
        change = ControlledPatch(state="running", last_attempt_id="0")
        outcomes = await asyncio.gather(
            first.patch_controlled(f"twice-{n}", change),
            second.patch_controlled(f"twice-{n}", change),
            return_exceptions=True,
        )
        assert sorted(type(o).__name__ for o in outcomes) == ["ConflictError", "ControlledRollout"], outcomes
        assert all(isinstance(o, ConflictError) for o in outcomes if isinstance(o, Exception))
        assert len(await second.list_attempts(f"twice-{n}")) == 1


async def test_a_model_registered_as_the_proxy_pauses_is_held_by_the_pause(two_stores: tuple[Store, Store]) -> None:
    """A trainer's pause through one replica while a model is registered (endpoints, then its alias) through
    another: whichever runs first, the alias ends paused and is the pause's, so the resume resumes it. Each write
    that reads which aliases the pause holds takes the pause's turn first."""
    first, second = two_stores

    async def register(name: str) -> None:
        await second.put_engine_models([EngineModel(model=name, endpoint=f"http://127.0.0.1:9/{name}")])
        await second.put_model(name, backends_of(name, await second.engine_models()))

    for n in range(10):
        name = f"model-{n}"
        await asyncio.gather(first.pause_proxy(5, None), register(name))
        assert (await first.get_model(name)).paused
        assert name in (await first.proxy_pause()).aliases
        _, resumed = await second.resume_proxy()
        assert name in [m.alias for m in resumed] and not (await first.get_model(name)).paused
