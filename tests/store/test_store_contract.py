"""Store contract: the queue (priority + FIFO, idempotent enqueue, groups), resources, spans and their
sequence ids, waiting (wait_for_rollouts, long-poll claim), cursor pagination, bad input (and that a refused
write leaves nothing half-written), model aliases and API keys. Runs on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import sqlite3
from typing import TYPE_CHECKING, Any

import asyncpg
import pydantic
import pytest

from rollway.store import (
    AttemptStatus,
    ClaimFilter,
    ConflictError,
    ExportQuery,
    NotFoundError,
    RolloutConfig,
    RolloutStatus,
    Span,
    Store,
    StoreValidationError,
    TaskSpec,
    ids,
)
from rollway.store.signals import Signal
from rollway.store.sql import lifecycle
from rollway.store.sql import sequences as sequences_module
from rollway.store.sql import spans as spans_module
from support.store_helpers import enqueue_one, filled, span

if TYPE_CHECKING:
    from support.clock import FakeClock


async def claim_ids(store: Store, limit: int = 100) -> list[str]:
    return [c.rollout.rollout_id for c in await store.claim("w1", limit=limit)]


async def all_rollouts(store: Store) -> list[Any]:
    return (await store.list_rollouts(limit=10_000)).items


class WaitSpy:
    """Records when a store waiter starts blocking on a signal, so tests sync on it instead of sleeping, and how
    many of its waits ended by their timeout rather than by a wake-up, so tests check that a waiter was woken
    without timing it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered = asyncio.Event()
        self.timed_out = 0
        original = Signal.wait

        async def wait(generation: asyncio.Event, timeout: float) -> None:
            self.entered.set()
            await original(generation, timeout)
            if not generation.is_set():
                self.timed_out += 1

        monkeypatch.setattr(Signal, "wait", staticmethod(wait))


# -- queue order -------------------------------------------------------------------------------------------


async def test_a_claim_takes_only_the_rollouts_its_filter_names(store: Store) -> None:
    tasks = [
        TaskSpec(input=0, mode="train", metadata={"step": 3, "split": "a"}),
        TaskSpec(input=1, mode="val", metadata={"step": 3}),
        TaskSpec(input=2, mode="train", metadata={"step": 4, "split": "a", "hard": True}),
        TaskSpec(input=3, mode="train", group_size=2, metadata={"step": 3, "split": "b"}),
        TaskSpec(input=4),
    ]
    queued = await store.enqueue(tasks)
    by_input = {r.input: r.rollout_id for r in queued if r.group_index in (None, 0)}

    async def taking(**where: Any) -> list[Any]:
        return [c.rollout.input for c in await store.claim("w", limit=10, where=ClaimFilter(**where))]

    assert await taking(mode="val") == [1]
    assert await taking(metadata={"step": 3, "split": "a"}) == [0]
    assert await taking(metadata={"hard": True}) == [2]
    group = next(r.group_id for r in queued if r.input == 3)
    assert await taking(mode="train", group_id=group) == [3, 3]
    assert await taking(mode="test") == []  # nothing of that mode: nothing taken, the rest left queued
    assert [c.rollout.rollout_id for c in await store.claim("w", limit=10)] == [by_input[4]]
    bads: list[dict[str, Any]] = [{"k": None}, {"k": [1]}, {'a"b': 1}]
    for bad in bads:
        with pytest.raises(StoreValidationError):
            await store.claim("w", where=ClaimFilter.model_construct(metadata=bad))


async def test_a_metadata_filter_compares_json_values_by_type_on_every_engine(store: Store) -> None:
    """``3`` matches ``3`` and ``3.0``, ``true`` only ``true`` (not ``1``), ``"1"`` only the string, and a filter
    never matches an array or an object, the same on SQLite and PostgreSQL; the export filter agrees."""
    values: list[Any] = [1, True, "1", 3.0, 3, [1], {"x": 1}, False, 0]
    queued = await store.enqueue([TaskSpec(input=i, metadata={"n": v}) for i, v in enumerate(values)])
    assert len(queued) == len(values)

    async def taking(value: Any) -> list[Any]:
        claimed = await store.claim("w", limit=10, where=ClaimFilter(metadata={"n": value}))
        return sorted(c.rollout.input for c in claimed)

    assert await taking("[1]") == []
    assert await taking('{"x": 1}') == []
    assert await taking(3) == [3, 4]
    assert await taking(True) == [1]
    assert await taking("1") == [2]
    assert await taking(1.0) == [0]
    assert await taking(False) == [7]
    assert await taking(0) == [8]
    left = await store.claim("w", limit=10)
    assert sorted(c.rollout.input for c in left) == [5, 6]
    for bad in (math.nan, math.inf):
        with pytest.raises(StoreValidationError):
            await store.claim("w", where=ClaimFilter(metadata={"n": bad}))


async def test_claims_follow_priority_then_enqueue_order(store: Store, clock: FakeClock) -> None:
    ids = {}
    for name, priority in [("a", 0), ("b", 5), ("c", 0), ("d", 5), ("e", -1), ("f", 0)]:
        ids[name] = await enqueue_one(store, input=name, priority=priority)
        clock.advance(1)
    order = [ids[n] for n in ("b", "d", "a", "c", "f", "e")]
    one_by_one = []
    for _ in order:
        [claimed] = await store.claim("w1")
        one_by_one.append(claimed.rollout.rollout_id)
    assert one_by_one == order


async def test_claim_many_returns_queue_order(store: Store) -> None:
    # One batch, one timestamp: enqueue order within the batch decides.
    batch = await store.enqueue([{"input": i, "priority": 1 if i in (3, 7) else 0} for i in range(10)])
    ids = [r.rollout_id for r in batch]
    expected = [ids[3], ids[7]] + [ids[i] for i in range(10) if i not in (3, 7)]
    assert await claim_ids(store, limit=4) == expected[:4]
    assert await claim_ids(store, limit=100) == expected[4:]
    assert await store.claim("w1") == []


async def test_requeued_rollouts_go_to_the_back_of_the_queue(store: Store, clock: FakeClock) -> None:
    retry = RolloutConfig(max_attempts=3, retry_condition=["failed"])
    a = await enqueue_one(store, input="a", config=retry)
    clock.advance(1)
    b = await enqueue_one(store, input="b")
    clock.advance(1)
    [first] = await store.claim("w1")
    assert first.rollout.rollout_id == a
    clock.advance(1)
    await store.update_attempt(a, first.attempt.attempt_id, status="failed")
    clock.advance(1)
    c = await enqueue_one(store, input="c")
    assert await claim_ids(store, limit=1) == [b]
    [again] = await store.claim("w1")
    assert again.rollout.rollout_id == a
    assert again.attempt.sequence_id == 2
    assert await claim_ids(store) == [c]


async def test_requeued_high_priority_rollout_still_precedes_lower_priority(store: Store, clock: FakeClock) -> None:
    retry = RolloutConfig(max_attempts=2, retry_condition=["failed"])
    high = await enqueue_one(store, priority=9, config=retry)
    clock.advance(1)
    low = await enqueue_one(store, priority=0)
    [claimed] = await store.claim("w1")
    assert claimed.rollout.rollout_id == high
    clock.advance(1)
    await store.update_attempt(high, status="failed")
    assert await claim_ids(store) == [high, low]


async def test_a_claimed_rollout_is_handed_out_once(store: Store) -> None:
    await store.enqueue([{"input": i} for i in range(5)])
    first = await claim_ids(store, limit=3)
    second = await claim_ids(store, limit=3)
    assert len(first) == 3 and len(second) == 2
    assert not set(first) & set(second)
    assert await store.claim("w1") == []


async def test_concurrent_claims_with_one_key_all_get_what_one_of_them_took(store: Store) -> None:
    """Retries of one claim can overlap the first try (a read timeout, another replica): on PostgreSQL the
    transactions race to insert the same derived attempt ids, and the loser reads the winner's claim."""
    await store.enqueue([{"input": i} for i in range(8)])
    results = await asyncio.gather(*(store.claim("w1", limit=2, idempotency_key="race") for _ in range(6)))
    taken = {tuple(c.attempt.attempt_id for c in claims) for claims in results}
    assert len(taken) == 1 and len(next(iter(taken))) == 2
    started = await asyncio.gather(*(store.start_rollout({"input": "s"}, "w1", idempotency_key="go") for _ in range(4)))
    assert len({s.rollout.rollout_id for s in started}) == 1
    assert len(await store.claim("w2", limit=10)) == 6


async def test_a_claim_sent_again_with_its_key_gets_what_the_first_took(store: Store) -> None:
    await store.enqueue([{"input": i} for i in range(5)])
    first = await store.claim("w1", limit=2, idempotency_key="c-1")
    assert [c.rollout.input for c in first] == [0, 1]
    await store.update_attempt(first[0].rollout.rollout_id, status="running")
    again = await store.claim("w1", limit=2, idempotency_key="c-1")
    assert [(c.rollout.rollout_id, c.attempt.attempt_id) for c in again] == [
        (c.rollout.rollout_id, c.attempt.attempt_id) for c in first
    ]
    assert again[0].attempt.status == "running"  # as it is now
    with pytest.raises(ConflictError, match="c-1"):
        await store.claim("w2", limit=2, idempotency_key="c-1")
    # Nothing more was taken: the other three are still queued, for any claim with another key or none.
    assert [c.rollout.input for c in await store.claim("w1", limit=5, idempotency_key="c-2")] == [2, 3, 4]
    # Once the claimed attempt is over, the key gets no claim back (nobody should run it again).
    await store.update_attempt(first[1].rollout.rollout_id, status="failed")
    with pytest.raises(ConflictError, match="is over"):
        await store.claim("w1", limit=2, idempotency_key="c-1")
    assert await store.claim("w1", idempotency_key="c-3") == []
    # A key whose first claim found the queue empty takes what has arrived since.
    [late] = await store.enqueue([{"input": 5}])
    assert [c.rollout.rollout_id for c in await store.claim("w1", idempotency_key="c-3")] == [late.rollout_id]


# -- enqueue: idempotency, groups, resources ---------------------------------------------------------------


async def test_enqueue_is_idempotent_by_client_rollout_id(store: Store, clock: FakeClock) -> None:
    [first] = await store.enqueue([{"rollout_id": "task-1", "input": {"v": 1}}])
    clock.advance(5)
    [second] = await store.enqueue([{"rollout_id": "task-1", "input": {"v": 2}}])
    assert second.rollout_id == "task-1"
    assert second.input == {"v": 1}
    assert second.start_time == first.start_time
    rollouts = await all_rollouts(store)
    assert [r.rollout_id for r in rollouts] == ["task-1"]
    assert len(await store.claim("w1", limit=10)) == 1


async def test_enqueue_idempotency_returns_the_stored_rollout_in_any_status(store: Store) -> None:
    await store.enqueue([{"rollout_id": "task-2", "input": 1}])
    [claimed] = await store.claim("w1")
    await store.update_attempt("task-2", status="succeeded")
    [again] = await store.enqueue([{"rollout_id": "task-2", "input": 2}])
    assert again.status == RolloutStatus.SUCCEEDED
    assert again.attempt_count == 1
    assert claimed.rollout.rollout_id == "task-2"
    assert await store.claim("w1") == []


async def test_enqueue_batch_mixing_new_and_known_ids(store: Store) -> None:
    await store.enqueue([{"rollout_id": "known", "input": "old"}])
    result = await store.enqueue(
        [{"rollout_id": "known", "input": "new"}, {"rollout_id": "fresh", "input": "x"}, {"input": "anon"}]
    )
    assert [r.rollout_id for r in result][:2] == ["known", "fresh"]
    assert result[0].input == "old"
    assert result[2].input == "anon"
    assert len(await all_rollouts(store)) == 3


async def test_duplicate_ids_within_one_batch_make_one_rollout(store: Store) -> None:
    await store.enqueue([{"rollout_id": "dup", "input": 1}, {"rollout_id": "dup", "input": 2}])
    assert [r.rollout_id for r in await all_rollouts(store)] == ["dup"]


async def test_group_size_makes_n_rollouts_sharing_a_group(store: Store) -> None:
    rollouts = await store.enqueue([{"input": {"q": "same"}, "group_size": 4}])
    assert len(rollouts) == 4
    group_ids = {r.group_id for r in rollouts}
    assert len(group_ids) == 1 and None not in group_ids
    assert [r.group_index for r in rollouts] == [0, 1, 2, 3]
    assert all(r.group_size == 4 and r.input == {"q": "same"} for r in rollouts)
    assert len({r.rollout_id for r in rollouts}) == 4
    [group_id] = group_ids
    assert group_id is not None
    group = await store.get_group(group_id)
    assert [r.rollout_id for r in group] == [r.rollout_id for r in rollouts]


async def test_group_with_client_ids_is_idempotent(store: Store) -> None:
    first = await store.enqueue([{"rollout_id": "g7", "input": 1, "group_size": 3}])
    assert [r.rollout_id for r in first] == ["g7-0", "g7-1", "g7-2"]
    assert {r.group_id for r in first} == {"g7"}
    again = await store.enqueue([{"rollout_id": "g7", "input": 2, "group_size": 3}])
    assert [r.rollout_id for r in again] == ["g7-0", "g7-1", "g7-2"]
    assert len(await all_rollouts(store)) == 3


async def test_a_repeated_idempotency_key_returns_what_the_first_call_queued(store: Store, clock: FakeClock) -> None:
    tasks: list[dict[str, Any]] = [
        {"input": {"q": "a"}},
        {"input": {"q": "b"}, "group_size": 3},
        {"rollout_id": "mine", "input": "c"},
    ]
    first = await store.enqueue(tasks, idempotency_key="k-1")
    assert len(first) == 5 and first[4].rollout_id == "mine"
    assert all(r.rollout_id.startswith("ro-") and len(r.rollout_id) == 15 for r in first[:4])
    group = first[1].group_id
    assert group is not None and group.startswith("gr-") and {r.group_id for r in first[1:4]} == {group}
    assert [r.group_index for r in first[:4]] == [None, 0, 1, 2]
    clock.advance(5)
    again = await store.enqueue(tasks, idempotency_key="k-1")
    assert [(r.rollout_id, r.start_time) for r in again] == [(r.rollout_id, r.start_time) for r in first]
    assert len(await all_rollouts(store)) == 5
    # A client's own rollout_id keeps its rule under any key: a known one returns the stored rollout.
    [mine] = await store.enqueue([{"rollout_id": "mine", "input": "changed"}], idempotency_key="k-other")
    assert (mine.rollout_id, mine.input) == ("mine", "c")
    # Another key (or none) queues the same tasks anew, under other ids.
    other = await store.enqueue(tasks[:2], idempotency_key="k-2")
    plain = await store.enqueue(tasks[:2])
    assert not {r.rollout_id for r in other + plain} & {r.rollout_id for r in first}
    assert len(await all_rollouts(store)) == 13


async def test_an_idempotency_key_sent_with_other_tasks_is_a_conflict(store: Store) -> None:
    await store.enqueue([{"input": {"q": "a"}, "group_size": 2}], idempotency_key="k-3")
    with pytest.raises(ConflictError, match="k-3"):
        await store.enqueue([{"input": {"q": "changed"}, "group_size": 2}], idempotency_key="k-3")
    with pytest.raises(ConflictError):
        await store.enqueue([{"input": {"q": "a"}}], idempotency_key="k-3")  # not a group now: other indexes
    assert len(await all_rollouts(store)) == 2


async def test_explicit_group_id_is_kept(store: Store) -> None:
    rollouts = await store.enqueue([{"input": 1, "group_id": "grp", "group_size": 2}])
    assert [(r.group_id, r.group_index) for r in rollouts] == [("grp", 0), ("grp", 1)]


async def test_enqueue_without_resources_gets_the_latest_at_enqueue_time(store: Store) -> None:
    before = await enqueue_one(store)
    assert (await store.get_rollout(before)).resources_id is None
    r1 = await store.add_resources({"llm": {"model": "m1"}})
    with_r1 = await enqueue_one(store)
    r2 = await store.add_resources({"llm": {"model": "m2"}})
    with_r2 = await enqueue_one(store)
    pinned = await enqueue_one(store, resources_id=r1.resources_id)
    assert (await store.get_rollout(with_r1)).resources_id == r1.resources_id
    assert (await store.get_rollout(with_r2)).resources_id == r2.resources_id
    assert (await store.get_rollout(pinned)).resources_id == r1.resources_id
    assert (await store.get_rollout(before)).resources_id is None


async def test_claim_hands_out_the_rollouts_resources(store: Store) -> None:
    r1 = await store.add_resources({"prompt": "v1"})
    rollout_id = await enqueue_one(store)
    await store.update_resources(r1.resources_id, {"prompt": "v2"})
    [claimed] = await store.claim("w1")
    assert claimed.rollout.rollout_id == rollout_id
    assert claimed.resources is not None
    assert claimed.resources.resources_id == r1.resources_id
    assert claimed.resources.version == 2
    assert claimed.resources.resources == {"prompt": "v2"}


async def test_resources_add_update_get_and_latest(store: Store, clock: FakeClock) -> None:
    assert await store.latest_resources() is None
    a = await store.add_resources({"prompt": "a1"})
    assert a.version == 1
    assert (await store.latest_resources()) == a
    clock.advance(1)
    b = await store.add_resources({"prompt": "b1"})
    assert b.resources_id != a.resources_id
    assert (await store.latest_resources()) == b
    clock.advance(1)
    a2 = await store.update_resources(a.resources_id, {"prompt": "a2"})
    assert (a2.resources_id, a2.version, a2.resources) == (a.resources_id, 2, {"prompt": "a2"})
    assert a2.create_time == a.create_time
    assert a2.update_time == clock.now
    assert (await store.latest_resources()) == a2
    assert (await store.get_resources(a.resources_id)) == a2
    assert (await store.get_resources(b.resources_id)) == b
    a3 = await store.update_resources(a.resources_id, {"prompt": "a3"})
    assert a3.version == 3
    page = await store.list_resources()
    assert [(r.resources_id, r.version) for r in page.items] == [(a.resources_id, 3), (b.resources_id, 1)]


async def test_update_resources_of_a_new_id_creates_version_1(store: Store) -> None:
    created = await store.update_resources("my-bundle", {"prompt": "p"})
    assert (created.resources_id, created.version) == ("my-bundle", 1)
    assert (await store.latest_resources()) == created


@pytest.mark.parametrize("bad", [[], {"": 1}, "text", {1: 2}])
async def test_malformed_resources_are_refused(store: Store, bad: Any) -> None:
    with pytest.raises(StoreValidationError):
        await store.add_resources(bad)
    assert await store.latest_resources() is None


@pytest.mark.parametrize(
    "value",
    [0, 1, -7, 3.5, 2**62, True, False, None, "3", "", [1, "a", None], {"k": [0, {"n": 1.5}]}, "h\u00e9llo"],
    ids=repr,
)
async def test_any_json_input_and_metadata_round_trip(store: Store, value: Any) -> None:
    [rollout] = await store.enqueue([{"input": value, "metadata": {"v": value}}])
    stored = await store.get_rollout(rollout.rollout_id)
    assert (stored.input, type(stored.input)) == (value, type(value))
    assert stored.metadata == {"v": value}
    [claimed] = await store.claim("w1")
    assert (claimed.rollout.input, type(claimed.rollout.input)) == (value, type(value))


async def test_a_random_id_that_comes_up_again_is_drawn_again(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random ids have 48 bits: one that a stored rollout or attempt has already is drawn again, rather than the
    write being refused or, next to a task with its own id, answered with the other rollout."""
    [old] = await store.enqueue([{"input": "old"}])
    [old_claim] = await store.claim("w")
    taken = old.rollout_id

    def draws(*values: str) -> None:
        it = iter(values)
        monkeypatch.setattr(ids, "rollout_id", lambda: next(it))

    draws(taken, "ro-00000000000a")
    mixed = await store.enqueue([{"input": "second"}, {"input": "own", "rollout_id": "mine"}])
    assert [(r.rollout_id, r.input) for r in mixed] == [("ro-00000000000a", "second"), ("mine", "own")]
    draws("ro-00000000000b", "ro-00000000000b", taken, "ro-00000000000c")  # also twice in one request
    plain = await store.enqueue([{"input": "third"}, {"input": "fourth"}])
    assert [(r.rollout_id, r.input) for r in plain] == [("ro-00000000000b", "third"), ("ro-00000000000c", "fourth")]
    draws(taken, "ro-00000000000d")
    started = await store.start_rollout({"input": "started"})
    assert (started.rollout.rollout_id, started.rollout.input) == ("ro-00000000000d", "started")
    assert (await store.get_rollout(taken)).input == "old"

    def attempt_draws(*values: str) -> None:
        it = iter(values)
        monkeypatch.setattr(ids, "attempt_id", lambda: next(it))

    attempt_draws(old_claim.attempt.attempt_id, "at-00000000000e")
    [claimed] = await store.claim("w2")
    assert claimed.attempt.attempt_id == "at-00000000000e"
    attempt_draws("at-00000000000e", "at-00000000000f")
    renewed = await store.start_attempt(claimed.rollout.rollout_id)
    assert renewed.attempt.attempt_id == "at-00000000000f"


# -- spans and sequence ids -------------------------------------------------------------------------------


async def test_sequence_ids_run_1_to_n_per_attempt_and_restart_for_attempt_2(store: Store) -> None:
    rollout_id = await enqueue_one(store, config=RolloutConfig(max_attempts=2, retry_condition=["failed"]))
    [first] = await store.claim("w1")
    one = [await store.add_span(span(rollout_id, first.attempt.attempt_id)) for _ in range(3)]
    assert [s.sequence_id for s in one if s] == [1, 2, 3]
    await store.update_attempt(rollout_id, status="failed")
    [second] = await store.claim("w1")
    two = await store.add_spans([span(rollout_id) for _ in range(2)])
    assert [(s.attempt_id, s.sequence_id) for s in two] == [(second.attempt.attempt_id, 1)] * 1 + [
        (second.attempt.attempt_id, 2)
    ]
    everything = await store.query_spans(rollout_id)
    assert [(s.attempt_id, s.sequence_id) for s in everything] == [
        (first.attempt.attempt_id, 1),
        (first.attempt.attempt_id, 2),
        (first.attempt.attempt_id, 3),
        (second.attempt.attempt_id, 1),
        (second.attempt.attempt_id, 2),
    ]
    latest = await store.query_spans(rollout_id, "latest")
    assert [s.sequence_id for s in latest] == [1, 2]
    assert [s.sequence_id for s in await store.query_spans(rollout_id, first.attempt.attempt_id)] == [1, 2, 3]


async def test_a_queued_rollout_has_no_spans_rather_than_no_attempt(store: Store) -> None:
    """Agent-lightning answers an empty page for the latest attempt's spans of a rollout with none; a named
    attempt that does not exist is still not found."""
    rollout_id = await enqueue_one(store)
    assert await store.query_spans(rollout_id, "latest") == []
    assert await store.query_spans(rollout_id) == []
    with pytest.raises(NotFoundError):
        await store.query_spans(rollout_id, "at-000000000000")
    with pytest.raises(NotFoundError):
        await store.query_spans("ro-unknown", "latest")


async def test_sequence_ids_of_different_rollouts_are_independent(store: Store) -> None:
    await store.enqueue([{"input": 1}, {"input": 2}])
    a, b = await store.claim("w1", limit=2)
    for _ in range(2):
        await store.add_span(span(a.rollout.rollout_id))
    written = await store.add_span(span(b.rollout.rollout_id))
    assert written is not None and written.sequence_id == 1


async def test_a_batch_naming_the_latest_attempt_by_id_and_by_default_gets_sequence_ids_in_its_order(
    store: Store,
) -> None:
    """A span without ``attempt_id`` goes to the latest attempt: the same attempt as the spans naming it, so one
    order for all of them, the request's (and spans of another rollout in between do not change it)."""
    await store.enqueue([{"input": 1}, {"input": 2}])
    a, b = await store.claim("w1", limit=2)
    rid, aid, other = a.rollout.rollout_id, a.attempt.attempt_id, b.rollout.rollout_id
    batch = [
        span(rid, aid, span_id="one"),
        span(rid, None, span_id="two"),
        span(other, None, span_id="elsewhere"),
        span(rid, aid, span_id="three"),
        span(rid, None, span_id="four"),
    ]

    written = await store.add_spans(batch)

    assert [(s.span_id, s.sequence_id) for s in written] == [
        ("one", 1),
        ("two", 2),
        ("elsewhere", 1),
        ("three", 3),
        ("four", 4),
    ]
    assert {s.attempt_id for s in written if s.rollout_id == rid} == {aid}
    assert [s.span_id for s in await store.query_spans(rid, aid)] == ["one", "two", "three", "four"]


async def test_a_given_sequence_id_moves_the_counter_forward(store: Store) -> None:
    rollout_id = await enqueue_one(store)
    await store.claim("w1")
    first = await store.add_span(span(rollout_id))
    given = await store.add_span(span(rollout_id, sequence_id=10))
    after = await store.add_span(span(rollout_id))
    assert first is not None and given is not None and after is not None
    assert (first.sequence_id, given.sequence_id, after.sequence_id) == (1, 10, 11)
    # A lower given id (allocated earlier, written late) is stored as given and does not move the counter back.
    late = await store.add_span(span(rollout_id, sequence_id=5))
    nxt = await store.add_span(span(rollout_id))
    assert late is not None and nxt is not None
    assert (late.sequence_id, nxt.sequence_id) == (5, 12)
    assert [s.sequence_id for s in await store.query_spans(rollout_id)] == [1, 5, 10, 11, 12]


async def test_allocate_sequence_then_add_span_with_it(store: Store) -> None:
    rollout_id = await enqueue_one(store)
    [claimed] = await store.claim("w1")
    attempt_id, seq = await store.allocate_sequence(rollout_id)
    assert (attempt_id, seq) == (claimed.attempt.attempt_id, 1)
    assert attempt_id is not None
    assert await store.allocate_sequence(rollout_id, attempt_id) == (attempt_id, 2)
    _, block = await store.allocate_sequence(rollout_id, attempt_id, count=3)
    assert block == 3  # reserves 3, 4, 5
    assert await store.next_sequence_id(rollout_id, attempt_id) == 6
    # The second call finishes first: arrival order is kept by the allocated ids.
    written = await store.add_spans(
        [span(rollout_id, attempt_id, sequence_id=2), span(rollout_id, attempt_id, sequence_id=1)]
    )
    assert [s.sequence_id for s in written] == [2, 1]
    auto = await store.add_span(span(rollout_id))
    assert auto is not None and auto.sequence_id == 7
    assert [s.sequence_id for s in await store.query_spans(rollout_id)] == [1, 2, 7]


async def test_begin_call_allocates_in_arrival_order_and_tells_the_rollout_deadline(store: Store) -> None:
    timed = await enqueue_one(store, input=1, config={"timeout_seconds": 30.5})
    untimed = await enqueue_one(store, input=2)
    claims = {c.rollout.rollout_id: c.attempt for c in await store.claim("w1", limit=2)}
    first = await store.begin_call(timed, None)  # the latest attempt
    assert (first.rollout_id, first.attempt_id, first.sequence_id) == (timed, claims[timed].attempt_id, 1)
    assert first.deadline == pytest.approx(claims[timed].start_time + 30.5)
    second = await store.begin_call(timed, claims[timed].attempt_id)
    assert (second.sequence_id, second.deadline) == (2, first.deadline)
    other = await store.begin_call(untimed, claims[untimed].attempt_id)
    assert (other.sequence_id, other.deadline) == (1, None)
    await store.cancel(untimed)
    with pytest.raises(ConflictError, match="cancelled"):
        await store.begin_call(untimed, None)
    with pytest.raises(NotFoundError):
        await store.begin_call("ro-missing", None)


async def test_reusing_a_stored_sequence_id_is_a_conflict_naming_it_and_writes_nothing(store: Store) -> None:
    rollout_id = await enqueue_one(store)
    [claimed] = await store.claim("w1")
    aid = claimed.attempt.attempt_id
    held = await store.add_span(span(rollout_id, sequence_id=1))
    assert held is not None
    taken = f"sequence_id 1 of attempt {aid} is already taken \\(by span '{held.span_id}'\\)"
    with pytest.raises(ConflictError, match=taken):
        await store.add_spans([span(rollout_id, sequence_id=2), span(rollout_id, sequence_id=1)])
    with pytest.raises(ConflictError, match=f"sequence_id 3 of attempt {aid} is already taken"):
        await store.add_spans([span(rollout_id, sequence_id=3), span(rollout_id, sequence_id=3)])
    with pytest.raises(ConflictError, match=taken):  # the gateway's write of a call's span
        await store.record_call(Span.model_validate(span(rollout_id, aid, sequence_id=1)))
    assert [s.sequence_id for s in await store.query_spans(rollout_id)] == [1]
    await store.add_span(span(None, sequence_id=1))
    with pytest.raises(ConflictError, match="sequence_id 1 of the unattributed spans is already taken"):
        await store.add_span(span(None, sequence_id=1))


async def test_duplicate_span_id_is_skipped(store: Store) -> None:
    rollout_id = await enqueue_one(store)
    await store.claim("w1")
    original = span(rollout_id, name="first")
    assert await store.add_span(original) is not None
    assert await store.add_span({**original, "name": "second"}) is None
    other = span(rollout_id)
    written = await store.add_spans([other, {**other, "name": "again"}, original])
    assert [s.span_id for s in written] == [other["span_id"]]
    stored = await store.query_spans(rollout_id)
    assert [(s.span_id, s.name) for s in stored] == [(original["span_id"], "first"), (other["span_id"], "llm.call")]


async def test_a_batch_of_several_rollouts_locks_them_in_id_order_and_answers_in_request_order(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two batches naming rollouts in other orders must lock them in one order (else, on PostgreSQL, they can
    deadlock); what a batch wrote still comes back in the order it was sent."""
    first, second, third = (await store.enqueue([{"input": i} for i in range(3)]))[::-1]  # ids not in order
    await store.claim("w1", limit=3)
    locked: list[str] = []
    original = lifecycle.load_rollout  # the one the span writes and their sequence ids import and call

    def recording(conn: Any, rollout_id: str, **kwargs: Any) -> Any:
        locked.append(rollout_id)
        return original(conn, rollout_id, **kwargs)

    monkeypatch.setattr(spans_module, "load_rollout", recording)
    monkeypatch.setattr(sequences_module, "load_rollout", recording)
    monkeypatch.setattr(spans_module, "sqlite_driver", lambda conn: None)  # the general path, on both engines
    batch = [span(r.rollout_id, name=f"{r.rollout_id}-{n}") for n in range(2) for r in (first, second, third)]
    batch.insert(1, span(None, name="unattributed"))
    written = await store.add_spans(batch)
    assert [s.name for s in written] == [s["name"] for s in batch]
    assert locked == sorted({first.rollout_id, second.rollout_id, third.rollout_id})


async def test_span_fields_and_unknown_fields_round_trip(store: Store) -> None:
    rollout_id = await enqueue_one(store)
    await store.claim("w1")
    sent = span(
        rollout_id,
        parent_id="parent-1",
        status={"status_code": "ERROR", "description": "boom"},
        start_time=1.5,
        end_time=2.25,
        attributes={"gen_ai.request.model": "m", "nested": {"list": [1, 2.5, None, "x"]}},
        events=[{"name": "e", "timestamp": 1.75, "attributes": {"k": "v"}}],
        links=[{"trace_id": "t2", "span_id": "s2"}],
        resource={"service.name": "agent"},
        kind="CLIENT",
        context={"trace_state": "a=b", "is_remote": False},
        custom_number=42,
    )
    await store.add_span(sent)
    [stored] = await store.query_spans(rollout_id)
    dumped = stored.model_dump()
    for key, value in sent.items():
        if key == "attempt_id":
            continue
        assert dumped[key] == value, key
    assert stored.model_extra == {
        "kind": "CLIENT",
        "context": {"trace_state": "a=b", "is_remote": False},
        "custom_number": 42,
    }


async def test_unattributed_spans_are_stored_and_readable(store: Store) -> None:
    rollout_id = await enqueue_one(store)
    await store.claim("w1")
    first = await store.add_span(span(None, name="loose-1"))
    await store.add_span(span(rollout_id))
    second = await store.add_span(Span(**span(None, name="loose-2")))
    assert first is not None and second is not None
    assert (first.rollout_id, first.attempt_id, first.sequence_id) == (None, None, 1)
    assert second.sequence_id == 2
    loose = await store.query_spans(None)
    assert [(s.name, s.rollout_id, s.attempt_id, s.sequence_id) for s in loose] == [
        ("loose-1", None, None, 1),
        ("loose-2", None, None, 2),
    ]
    assert [s.name for s in await store.query_spans(rollout_id)] == ["llm.call"]
    assert await store.allocate_sequence(None, None) == (None, 3)


async def test_query_spans_filters(store: Store) -> None:
    rollout_id = await enqueue_one(store)
    await store.claim("w1")
    await store.add_spans([span(rollout_id, name=n) for n in ("a", "b", "a", "c", "a")])
    assert [s.sequence_id for s in await store.query_spans(rollout_id, name="a")] == [1, 3, 5]
    assert [s.sequence_id for s in await store.query_spans(rollout_id, after_sequence=2, limit=2)] == [3, 4]


# -- waiting ----------------------------------------------------------------------------------------------


async def test_wait_for_rollouts_returns_finished_and_pending(store: Store) -> None:
    ids = [r.rollout_id for r in await store.enqueue([{"input": i} for i in range(4)])]
    claimed = await store.claim("w1", limit=2)
    assert [c.rollout.rollout_id for c in claimed] == ids[:2]
    await store.update_attempt(ids[0], status="succeeded")
    await store.update_attempt(ids[1], status="failed")
    await store.cancel(ids[2])
    done, pending = await store.wait_for_rollouts(ids, timeout=0)
    assert [(r.rollout_id, r.status) for r in done] == [
        (ids[0], RolloutStatus.SUCCEEDED),
        (ids[1], RolloutStatus.FAILED),
        (ids[2], RolloutStatus.CANCELLED),
    ]
    assert pending == [ids[3]]


async def test_wait_for_rollouts_returns_at_once_when_all_finished(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = WaitSpy(monkeypatch)
    rollout_id = await enqueue_one(store)
    await store.cancel(rollout_id)
    done, pending = await store.wait_for_rollouts([rollout_id, rollout_id], timeout=30)
    assert not spy.entered.is_set()  # it never waited
    assert [r.rollout_id for r in done] == [rollout_id]
    assert pending == []


async def test_wait_for_rollouts_wakes_when_another_task_finishes_it(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = WaitSpy(monkeypatch)
    store.poll_interval = 60.0  # only a wake-up, not a re-poll, can end the wait early
    rollout_id = await enqueue_one(store)
    [claimed] = await store.claim("w1")
    waiter = asyncio.create_task(store.wait_for_rollouts([rollout_id], timeout=20))
    await asyncio.wait_for(spy.entered.wait(), 10)
    assert not waiter.done()
    await store.update_attempt(rollout_id, claimed.attempt.attempt_id, status="succeeded")
    done, pending = await asyncio.wait_for(waiter, 30)
    assert spy.timed_out == 0  # woken, not timed out
    assert [(r.rollout_id, r.status) for r in done] == [(rollout_id, RolloutStatus.SUCCEEDED)]
    assert pending == []


async def test_wait_for_rollouts_wakes_when_the_watchdog_fails_it(
    store: Store, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = WaitSpy(monkeypatch)
    store.poll_interval = 60.0
    rollout_id = await enqueue_one(store, config=RolloutConfig(timeout_seconds=5))
    await store.claim("w1")
    waiter = asyncio.create_task(store.wait_for_rollouts([rollout_id], timeout=20))
    await asyncio.wait_for(spy.entered.wait(), 10)
    clock.advance(6)
    assert await store.sweep(force=True) == 1
    done, pending = await asyncio.wait_for(waiter, 30)
    assert spy.timed_out == 0  # woken, not timed out
    assert [r.status for r in done] == [RolloutStatus.FAILED]
    assert pending == []


async def test_wait_for_rollouts_times_out_with_pending_ids(store: Store) -> None:
    rollout_id = await enqueue_one(store)
    done, pending = await store.wait_for_rollouts([rollout_id], timeout=0.05)
    assert done == [] and pending == [rollout_id]


async def test_claim_with_wait_wakes_when_a_task_is_enqueued(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = WaitSpy(monkeypatch)
    store.poll_interval = 60.0
    claimer = asyncio.create_task(store.claim("w1", wait_seconds=20))
    await asyncio.wait_for(spy.entered.wait(), 10)
    assert not claimer.done()
    rollout_id = await enqueue_one(store, input="late")
    claimed = await asyncio.wait_for(claimer, 30)
    assert spy.timed_out == 0  # woken, not timed out
    assert [c.rollout.rollout_id for c in claimed] == [rollout_id]
    assert claimed[0].attempt.sequence_id == 1


async def test_claim_with_wait_wakes_when_a_rollout_is_requeued(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    rollout_id = await enqueue_one(store, config=RolloutConfig(max_attempts=2, retry_condition=["failed"]))
    [first] = await store.claim("w1")
    spy = WaitSpy(monkeypatch)
    store.poll_interval = 60.0
    claimer = asyncio.create_task(store.claim("w2", wait_seconds=20))
    await asyncio.wait_for(spy.entered.wait(), 10)
    await store.update_attempt(rollout_id, first.attempt.attempt_id, status="failed")
    claimed = await asyncio.wait_for(claimer, 30)
    assert spy.timed_out == 0  # woken, not timed out
    assert [(c.rollout.rollout_id, c.attempt.sequence_id) for c in claimed] == [(rollout_id, 2)]


async def test_claim_without_wait_returns_empty_at_once(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = WaitSpy(monkeypatch)
    assert await store.claim("w1") == []
    assert not spy.entered.is_set()  # it never waited


# -- cursor pagination ------------------------------------------------------------------------------------


async def test_list_rollouts_cursor_visits_each_rollout_exactly_once(store: Store) -> None:
    created = [r.rollout_id for r in await store.enqueue([{"input": i} for i in range(25)])]
    seen: list[str] = []
    sizes: list[int] = []
    cursor: str | None = None
    for _ in range(10):
        page = await store.list_rollouts(limit=10, cursor=cursor)
        seen.extend(r.rollout_id for r in page.items)
        sizes.append(len(page.items))
        cursor = page.next_cursor
        if cursor is None:
            break
    assert sizes == [10, 10, 5]
    assert seen == created


async def test_sorted_rollouts_filter_order_and_page_like_a_sort_in_python(store: Store, clock: FakeClock) -> None:
    # Ids whose code-point order differs from a natural-language collation's; null modes, resources, end times.
    names = ["ro-b", "ro-B", "ro-a", "ro-Z", "ro-_1", "ro-\u00e9", "ro-A2", "ro-ab"]
    modes = ["train", None, "val", "train", None, "test", "val", None]
    for i, (name, mode) in enumerate(zip(names, modes, strict=True)):
        if i == 3:
            await store.add_resources({"llm": {"model": "m"}})
        clock.advance(-5.0 if i % 3 == 0 else 7.0)  # start times not in creation order, and one tie below
        await store.enqueue([{"rollout_id": name, "input": i, "mode": mode}])
    await store.cancel("ro-Z")
    await store.cancel("ro-b")
    await claim_ids(store, limit=2)
    everything = await all_rollouts(store)  # creation order

    def value(rollout: Any, field: str) -> Any:
        got = getattr(rollout, field)
        return got.value if isinstance(got, RolloutStatus) else got

    filters: list[dict[str, Any]] = [
        {},
        {"status": ["queuing", "cancelled"]},
        {"id_contains": "ro-a"},
        {"rollout_ids": ["ro-B", "ro-ab", "ro-_1", "ro-nope"], "status": ["queuing"]},
        {"rollout_ids": []},
    ]
    for where in filters:
        matching = [
            r
            for r in everything
            if ("status" not in where or r.status.value in where["status"])
            and ("id_contains" not in where or where["id_contains"] in r.rollout_id)
            and ("rollout_ids" not in where or r.rollout_id in where["rollout_ids"])
        ]
        for sort_by in (None, "rollout_id", "start_time", "end_time", "mode", "resources_id", "status"):
            for descending in (False, True):
                ordered = matching
                if sort_by is not None:  # nulls last ascending; ties in creation order (a stable sort)
                    ordered = sorted(
                        matching,
                        key=lambda r: (value(r, sort_by) is None, value(r, sort_by) or 0),
                        reverse=descending,
                    )
                for limit, offset in ((None, 0), (3, 2), (2, 0), (None, 5)):
                    query = {"sort_by": sort_by, "descending": descending, "limit": limit, "offset": offset}
                    found, total = await store.sorted_rollouts(**where, **query)
                    window = ordered[offset:] if limit is None else ordered[offset : offset + limit]
                    assert [r.rollout_id for r in found] == [r.rollout_id for r in window], (where, query)
                    assert total == len(matching)
    for bad in ({"sort_by": "input"}, {"status": ["sleeping"]}):
        with pytest.raises(StoreValidationError):
            await store.sorted_rollouts(**bad)


async def test_list_rollouts_cursor_with_filters_and_exact_fit(store: Store) -> None:
    rollouts = await store.enqueue([{"input": i, "mode": "train" if i % 2 else "val"} for i in range(8)])
    train = [r.rollout_id for r in rollouts if r.mode == "train"]
    first = await store.list_rollouts(mode="train", limit=2)
    second = await store.list_rollouts(mode="train", limit=2, cursor=first.next_cursor)
    assert [r.rollout_id for r in first.items + second.items] == train
    assert second.next_cursor is None  # exactly 4 = 2 pages: no empty third page


async def pages(store: Store, limit: int, **query: Any) -> tuple[list[str], list[int]]:
    """Every rollout ``list_rollouts(**query)`` gives, following ``next_cursor``: (ids in order, page sizes)."""
    seen: list[str] = []
    sizes: list[int] = []
    cursor: str | None = None
    while True:
        page = await store.list_rollouts(limit=limit, cursor=cursor, **query)
        seen.extend(r.rollout_id for r in page.items)
        sizes.append(len(page.items))
        cursor = page.next_cursor
        if cursor is None or len(sizes) > 100:
            return seen, sizes


async def test_list_rollouts_newest_first_pages_through_rollouts_created_in_the_same_instant(store: Store) -> None:
    # The clock stands still: every rollout has the same start time, in one enqueue and across three.
    created = [r.rollout_id for r in await store.enqueue([{"input": i} for i in range(17)])]
    for n in (3, 4, 1):
        created += [r.rollout_id for r in await store.enqueue([{"input": i} for i in range(n)])]
    assert len({r.start_time for r in await all_rollouts(store)}) == 1
    newest_first = created[::-1]
    assert [r.rollout_id for r in (await store.list_rollouts(limit=1000, descending=True)).items] == newest_first
    for limit in (1, 4, 7, 25, 26):
        seen, sizes = await pages(store, limit, descending=True)
        assert seen == newest_first, limit  # none skipped, none repeated, in order
        assert sizes == [min(limit, 25 - i) for i in range(0, 25, limit)], limit  # an exact fit ends with no empty page
        ascending, _ = await pages(store, limit)
        assert ascending == created, limit
    # Rollouts created between two pages go to the top of the list; the next page goes on where the last ended.
    first = await store.list_rollouts(limit=10, descending=True)
    later = [r.rollout_id for r in await store.enqueue([{"input": i} for i in range(3)])]
    second = await store.list_rollouts(limit=10, cursor=first.next_cursor, descending=True)
    assert [r.rollout_id for r in first.items + second.items] == newest_first[:20]
    assert (await pages(store, 10, descending=True))[0] == later[::-1] + newest_first


async def test_list_rollouts_newest_first_with_each_filter(store: Store, clock: FakeClock) -> None:
    rollouts: list[Any] = []
    for i in range(12):
        clock.advance(10.0 if i % 4 else 0.0)  # rollouts 3 and 4, 7 and 8 start at the same time
        task = {"input": i, "mode": ("train", "val", None)[i % 3], "group_id": "g1" if i % 2 else "g2"}
        rollouts += await store.enqueue([task])
    created = [r.rollout_id for r in rollouts]
    for rollout_id in created[2::5]:
        await store.cancel(rollout_id)
    policy = []
    for claimed in await store.claim("w1", limit=4):
        attributes = {"gen_ai.request.model": "policy"}
        await store.add_span(span(claimed.rollout.rollout_id, claimed.attempt.attempt_id, attributes=attributes))
        policy.append(claimed.rollout.rollout_id)
    await store.update_attempt(policy[1], "latest", status="succeeded")
    everything = await all_rollouts(store)
    assert [r.rollout_id for r in everything] == created
    middle = rollouts[4].start_time  # rollout 3's too
    filters: list[tuple[dict[str, Any], Any]] = [
        ({"status": ["queuing"]}, lambda r: r.status == RolloutStatus.QUEUING),
        ({"status": ["cancelled", "preparing"]}, lambda r: r.status.value in ("cancelled", "preparing")),
        ({"mode": "train"}, lambda r: r.mode == "train"),
        ({"group_id": "g1", "mode": "val"}, lambda r: r.group_id == "g1" and r.mode == "val"),
        ({"started_after": middle}, lambda r: r.start_time >= middle),
        ({"started_before": middle, "group_id": "g2"}, lambda r: r.start_time < middle and r.group_id == "g2"),
        ({"rollout_ids": created[::3]}, lambda r: r.rollout_id in created[::3]),
        ({"called_model": "policy"}, lambda r: r.rollout_id in policy),
        (
            {"called_model": "policy", "status": ["running"]},
            lambda r: r.rollout_id in policy and r.status.value == "running",
        ),
    ]
    for where, keep in filters:
        matching = [r.rollout_id for r in everything if keep(r)]
        assert 0 < len(matching) < len(created), where  # each filter keeps some rollouts and leaves out others
        for limit in (1, 2, 1000):
            assert (await pages(store, limit, descending=True, **where))[0] == matching[::-1], (where, limit)
            assert (await pages(store, limit, **where))[0] == matching, (where, limit)


async def test_list_rollouts_filters_by_status(store: Store) -> None:
    ids = [r.rollout_id for r in await store.enqueue([{"input": i} for i in range(3)])]
    await store.cancel(ids[1])
    page = await store.list_rollouts(status=[RolloutStatus.QUEUING])
    assert [r.rollout_id for r in page.items] == [ids[0], ids[2]]
    page = await store.list_rollouts(status=["cancelled"])
    assert [r.rollout_id for r in page.items] == [ids[1]]


@pytest.mark.parametrize(
    "cursor",
    [
        "not a cursor!",
        "%%%",
        "cGs6YWJj",  # pk:abc
        "cGs6LTE",  # pk:-1
        "eHg6MTI",  # xx:12
        "cGs6OTk5OTk5OTk5OTk5OTk5OTk5OTk5",  # pk:999999999999999999999 (beyond any pk column)
        "cGs6OTk5OTk5OTk5OTk",  # pk:99999999999 (beyond a 32-bit pk)
        "//79",  # not UTF-8
    ],
)
async def test_garbage_cursor_is_a_validation_error(store: Store, cursor: str) -> None:
    await store.enqueue([{"input": 1}])
    with pytest.raises(StoreValidationError):
        await store.list_rollouts(cursor=cursor)
    with pytest.raises(StoreValidationError):
        await store.list_resources(cursor=cursor)


@pytest.mark.parametrize("limit", [0, -1, -100])
async def test_non_positive_limits_are_validation_errors(store: Store, limit: int) -> None:
    rollout_id = await enqueue_one(store)
    await store.claim("w1")
    with pytest.raises(StoreValidationError):
        await store.list_rollouts(limit=limit)
    with pytest.raises(StoreValidationError):
        await store.list_resources(limit=limit)
    with pytest.raises(StoreValidationError):
        await store.claim("w1", limit=limit)
    with pytest.raises(StoreValidationError):
        await store.query_spans(rollout_id, limit=limit)
    with pytest.raises(StoreValidationError):
        await store.allocate_sequence(rollout_id, count=limit)


async def test_oversized_limit_is_a_validation_error(store: Store) -> None:
    with pytest.raises(StoreValidationError):
        await store.list_rollouts(limit=10_001)
    with pytest.raises(StoreValidationError):
        await store.claim("w1", limit=1001)


# -- bad input: unknown ids ----------------------------------------------------------------------------------


async def test_unknown_rollout_ids_are_not_found(store: Store) -> None:
    calls = [
        store.get_rollout("missing"),
        store.get_attempt("missing"),
        store.list_attempts("missing"),
        store.update_attempt("missing", status="succeeded"),
        store.heartbeat("missing"),
        store.cancel("missing"),
        store.start_attempt("missing"),
        store.query_spans("missing"),
        store.add_span(span("missing")),
        store.allocate_sequence("missing"),
        store.wait_for_rollouts(["missing"], timeout=0),
        store.get_group("missing"),
    ]
    for call in calls:
        with pytest.raises(NotFoundError):
            await call
    assert await all_rollouts(store) == []


async def test_unknown_attempt_ids_are_not_found(store: Store) -> None:
    rollout_id = await enqueue_one(store)
    with pytest.raises(NotFoundError, match="no attempts"):
        await store.get_attempt(rollout_id)
    with pytest.raises(NotFoundError):
        await store.add_span(span(rollout_id))  # queued, no attempt yet
    await store.claim("w1")
    other = await enqueue_one(store)
    [other_claim] = await store.claim("w1")
    foreign = other_claim.attempt.attempt_id  # exists, but belongs to another rollout
    for attempt_id in ("at-missing", foreign):
        with pytest.raises(NotFoundError):
            await store.get_attempt(rollout_id, attempt_id)
        with pytest.raises(NotFoundError):
            await store.update_attempt(rollout_id, attempt_id, status="succeeded")
        with pytest.raises(NotFoundError):
            await store.heartbeat(rollout_id, attempt_id)
        with pytest.raises(NotFoundError):
            await store.add_span(span(rollout_id, attempt_id))
        with pytest.raises(NotFoundError):
            await store.query_spans(rollout_id, attempt_id)
    assert (await store.get_rollout(rollout_id)).status == RolloutStatus.PREPARING
    assert (await store.get_rollout(other)).status == RolloutStatus.PREPARING
    assert await store.query_spans(rollout_id) == []


async def test_unknown_catalog_ids_are_not_found(store: Store) -> None:
    with pytest.raises(NotFoundError):
        await store.get_resources("missing")
    with pytest.raises(NotFoundError):
        await store.get_model("missing")
    with pytest.raises(NotFoundError):
        await store.delete_model("missing")
    with pytest.raises(NotFoundError):
        await store.set_model_paused("missing", True)
    with pytest.raises(NotFoundError):
        await store.revoke_key("missing")
    with pytest.raises(NotFoundError):
        await store.get_worker("missing")


async def test_dequeue_records_the_worker_busy_then_keeps_it_busy_on_an_empty_queue(
    store: Store, clock: FakeClock
) -> None:
    rollout_id = await enqueue_one(store)
    [claimed] = await store.claim("w1")
    worker = await store.get_worker("w1")
    assert (worker.status, worker.current_rollout_id) == ("busy", rollout_id)
    assert worker.current_attempt_id == claimed.attempt.attempt_id
    clock.advance(5)
    assert await store.claim("w1") == []  # nothing queued: only the dequeue time moves
    after = await store.get_worker("w1")
    assert after.status == "busy" and after.current_attempt_id == claimed.attempt.attempt_id
    assert worker.last_dequeue_time is not None
    assert after.last_dequeue_time == worker.last_dequeue_time + 5
    assert await store.claim("w2") == []  # a worker first seen on an empty queue starts idle
    assert (await store.get_worker("w2")).status == "idle"


# -- bad input: invalid transitions (and nothing half-written) ------------------------------------------------


async def test_finished_attempt_cannot_change_outcome(store: Store) -> None:
    rollout_id = await enqueue_one(store)
    await store.claim("w1")
    await store.update_attempt(rollout_id, status="succeeded", metadata={"reward": 1})
    before = await store.get_rollout(rollout_id, with_attempts=True)
    with pytest.raises(ConflictError) as info:
        await store.update_attempt(rollout_id, status="failed", metadata={"reward": 0})
    assert "'succeeded'" in info.value.message and "'failed'" in info.value.message
    after = await store.get_rollout(rollout_id, with_attempts=True)
    assert after == before
    assert after.attempts is not None and after.attempts[0].metadata == {"reward": 1}


@pytest.mark.parametrize(
    ("setup", "target", "current"),
    [
        ("span", "preparing", "running"),
        ("timeout", "succeeded", "timeout"),
        ("timeout", "running", "timeout"),
        ("failed", "running", "failed"),
    ],
)
async def test_invalid_attempt_transition_is_a_conflict_naming_both_states(
    store: Store, clock: FakeClock, setup: str, target: str, current: str
) -> None:
    rollout_id = await enqueue_one(store, config=RolloutConfig(timeout_seconds=10))
    await store.claim("w1")
    if setup == "span":
        await store.add_span(span(rollout_id))
    elif setup == "timeout":
        clock.advance(11)
        await store.sweep(force=True)
    else:
        await store.update_attempt(rollout_id, status="failed")
    before = await store.get_rollout(rollout_id, with_attempts=True)
    with pytest.raises(ConflictError) as info:
        await store.update_attempt(rollout_id, status=target)
    assert f"'{current}'" in info.value.message and f"'{target}'" in info.value.message
    assert await store.get_rollout(rollout_id, with_attempts=True) == before


async def test_start_attempt_on_a_succeeded_rollout_is_refused_and_writes_nothing(store: Store) -> None:
    rollout_id = await enqueue_one(store)
    await store.claim("w1")
    await store.update_attempt(rollout_id, status="succeeded")
    with pytest.raises(ConflictError) as info:
        await store.start_attempt(rollout_id, worker_id="w2")
    assert "'succeeded'" in info.value.message and "'preparing'" in info.value.message
    rollout = await store.get_rollout(rollout_id, with_attempts=True)
    assert rollout.attempt_count == 1
    assert rollout.status == RolloutStatus.SUCCEEDED
    assert [a.sequence_id for a in rollout.attempts or []] == [1]


async def test_cancelling_a_failed_rollout_is_a_conflict(store: Store) -> None:
    rollout_id = await enqueue_one(store)
    await store.claim("w1")
    await store.update_attempt(rollout_id, status="failed")
    with pytest.raises(ConflictError, match=r"'failed'.*'cancelled'"):
        await store.cancel(rollout_id)
    assert (await store.get_rollout(rollout_id)).status == RolloutStatus.FAILED


async def test_start_rollout_with_a_taken_id_is_a_conflict(store: Store) -> None:
    await store.enqueue([{"rollout_id": "taken", "input": "original"}])
    with pytest.raises(ConflictError):
        await store.start_rollout({"rollout_id": "taken", "input": "other"})
    [rollout] = await all_rollouts(store)
    assert (rollout.input, rollout.status, rollout.attempt_count) == ("original", RolloutStatus.QUEUING, 0)


async def test_start_rollout_sent_again_with_its_key_returns_the_rollout_it_started(store: Store) -> None:
    first = await store.start_rollout({"input": "q"}, "w1", idempotency_key="s-1")
    await store.update_attempt(first.rollout.rollout_id, status="running")
    again = await store.start_rollout({"input": "q"}, "w1", idempotency_key="s-1")
    assert (again.rollout.rollout_id, again.attempt.attempt_id) == (first.rollout.rollout_id, first.attempt.attempt_id)
    assert again.attempt.status == "running" and again.rollout.attempt_count == 1
    for other_input, worker in (("changed", "w1"), ("q", "w2")):
        with pytest.raises(ConflictError, match="s-1"):
            await store.start_rollout({"input": other_input}, worker, idempotency_key="s-1")
    other = await store.start_rollout({"input": "q"}, "w1", idempotency_key="s-2")
    assert other.rollout.rollout_id != first.rollout.rollout_id
    assert len(await all_rollouts(store)) == 2


async def test_a_new_attempt_and_spans_sent_again_with_their_key_are_not_made_twice(store: Store) -> None:
    rid = (await store.start_rollout({"input": "q"}, "w1")).rollout.rollout_id
    second = await store.start_attempt(rid, "w1", idempotency_key="a-1")
    again = await store.start_attempt(rid, "w1", idempotency_key="a-1")
    assert again.attempt.attempt_id == second.attempt.attempt_id and again.rollout.attempt_count == 2
    with pytest.raises(ConflictError, match="a-1"):
        await store.start_attempt(rid, "w2", idempotency_key="a-1")
    raced = await asyncio.gather(*(store.start_attempt(rid, "w1", idempotency_key="a-2") for _ in range(4)))
    assert len({r.attempt.attempt_id for r in raced}) == 1 and raced[0].rollout.attempt_count == 3
    with pytest.raises(ConflictError, match="is over"):  # a-2's attempt replaced a-1's: nobody runs that again
        await store.start_attempt(rid, "w1", idempotency_key="a-1")

    # Span ids as the admin API derives them from the key for spans sent without one.
    tool = {
        **span(rid, name="tool", attributes={"i": 1, "x": float("nan")}),
        "span_id": ids.derived_hex("p-1", 0, "span"),
    }
    reward = span(rid, name="rollway.reward", attributes={"rollway.reward.value": 1.0})
    reward["span_id"] = ids.derived_hex("p-1", 1, "span")
    first = await store.add_spans([tool, reward], idempotency_key="p-1")
    await store.start_attempt(rid, "w1")  # a new attempt meanwhile: a retry still finds where they went
    retried = await asyncio.gather(*(store.add_spans([tool, reward], idempotency_key="p-1") for _ in range(3)))
    placed = [(s.span_id, s.attempt_id, s.sequence_id) for s in first]
    assert placed[0][2] == 1 and all([(s.span_id, s.attempt_id, s.sequence_id) for s in r] == placed for r in retried)
    for changed in (
        {"attributes": {"rollway.reward.value": 0.0}},
        {"name": "other"},
        {"attempt_id": second.attempt.attempt_id},  # not the attempt the first try wrote it to
    ):
        with pytest.raises(ConflictError, match="p-1"):
            await store.add_spans([tool, {**reward, **changed}], idempotency_key="p-1")
    assert [s.span_id for s in await store.query_spans(rid)] == [tool["span_id"], reward["span_id"]]

    # A client's own span id keeps its rule under a key: one per attempt, returned as stored when it has it.
    own = span(rid, name="tool", attributes={"i": 2})
    twice = [own, {**own, "attributes": {"i": 3}}]  # one id twice in a request: the first is the one written
    written = await store.add_spans(twice, idempotency_key="p-2")
    resent = await store.add_spans(twice, idempotency_key="p-2")
    assert [s.sequence_id for s in resent] == [s.sequence_id for s in written] == [written[0].sequence_id] * 2
    assert resent[0].attributes == {"i": 2}
    newest = await store.start_attempt(rid, "w1")
    [moved] = await store.add_spans([own], idempotency_key="p-3")  # another request, for the new attempt
    assert (moved.attempt_id, moved.sequence_id) == (newest.attempt.attempt_id, 1)


async def test_start_rollout_takes_a_single_task(store: Store) -> None:
    with pytest.raises(StoreValidationError, match="needs a group_id"):  # n rollouts? No: one, in a named group
        await store.start_rollout({"input": 1, "group_size": 2})
    assert await all_rollouts(store) == []
    alone = await store.start_rollout({"input": 1, "group_size": 1})
    assert (alone.rollout.group_id, alone.rollout.group_size, alone.rollout.group_index) == (None, None, None)


async def test_enqueue_with_unknown_resources_writes_nothing(store: Store) -> None:
    await store.add_resources({"prompt": "p"})
    with pytest.raises(StoreValidationError, match="nope"):
        await store.enqueue([{"input": "ok"}, {"input": "bad", "resources_id": "nope"}])
    with pytest.raises(StoreValidationError):
        await store.start_rollout({"input": "bad", "resources_id": "nope"})
    assert await all_rollouts(store) == []
    assert await store.claim("w1") == []


async def test_span_batch_with_one_bad_span_writes_none(store: Store) -> None:
    rollout_id = await enqueue_one(store)
    await store.claim("w1")
    with pytest.raises(NotFoundError):
        await store.add_spans([span(rollout_id), span("missing")])
    assert await store.query_spans(rollout_id) == []
    attempt = await store.get_attempt(rollout_id)
    assert attempt.status == AttemptStatus.PREPARING
    assert attempt.last_heartbeat_time is None
    written = await store.add_span(span(rollout_id))
    assert written is not None and written.sequence_id == 1


@pytest.mark.parametrize(
    "config",
    [
        {"max_attempts": 0},
        {"max_attempts": -1},
        {"timeout_seconds": -5},
        {"timeout_seconds": 0},
        {"unresponsive_seconds": -1},
        {"retry_condition": ["succeeded"]},
        {"retry_condition": ["failed", "preparing"]},
        {"retry_condition": ["bogus"]},
        {"unknown_option": 1},
    ],
)
async def test_invalid_rollout_config_is_a_validation_error(store: Store, config: dict[str, Any]) -> None:
    with pytest.raises(pydantic.ValidationError):
        RolloutConfig(**config)
    with pytest.raises(pydantic.ValidationError):
        TaskSpec(input=1, config=config)
    with pytest.raises(pydantic.ValidationError):
        await store.enqueue([{"input": 1}, {"input": 2, "config": config}])
    with pytest.raises(pydantic.ValidationError):
        await store.start_rollout({"input": 1, "config": config})
    assert await all_rollouts(store) == []


@pytest.mark.parametrize(
    "task",
    [
        {"input": 1, "group_size": 0},
        {"input": 1, "mode": "training"},
        {"input": 1, "rollout_id": ""},
        {"input": 1, "surprise": True},
        {"input": 1, "priority": "high"},
    ],
)
async def test_invalid_task_is_a_validation_error(store: Store, task: dict[str, Any]) -> None:
    with pytest.raises(pydantic.ValidationError):
        await store.enqueue([task])
    assert await all_rollouts(store) == []


async def test_retry_condition_is_deduplicated(store: Store) -> None:
    config = RolloutConfig(retry_condition=["failed", "timeout", "failed"])
    assert config.retry_condition == [AttemptStatus.FAILED, AttemptStatus.TIMEOUT]
    rollout_id = await enqueue_one(store, config=config)
    assert (await store.get_rollout(rollout_id)).config == config


async def test_other_bad_arguments_are_validation_errors(store: Store) -> None:
    rollout_id = await enqueue_one(store)
    await store.claim("w1")
    with pytest.raises(StoreValidationError):
        await store.update_attempt(rollout_id, status="bogus")
    with pytest.raises(StoreValidationError):
        await store.update_attempt(rollout_id, metadata=["not", "an", "object"])
    with pytest.raises(StoreValidationError):
        await store.add_span(span(None, "at-123"))  # an attempt without a rollout
    with pytest.raises(StoreValidationError):
        await store.wait_for_rollouts([rollout_id], timeout=-1)
    with pytest.raises(StoreValidationError):
        await store.claim("w1", wait_seconds=-1)
    with pytest.raises(StoreValidationError):
        await store.list_rollouts(status=["bogus"])
    with pytest.raises(pydantic.ValidationError):
        await store.add_span({**span(rollout_id), "sequence_id": 0})
    attempt = await store.get_attempt(rollout_id)
    assert attempt.status == AttemptStatus.PREPARING and attempt.metadata is None
    assert await store.query_spans(rollout_id) == []


# -- models and keys ---------------------------------------------------------------------------------------

SECRET = "sk-upstream-SECRET-0123456789"


async def test_put_get_list_delete_model(store: Store, clock: FakeClock) -> None:
    created = await store.put_model(
        "policy", [{"base_url": "http://vllm:8000/v1", "model": "qwen", "kind": "vllm"}], sampling={"t": 0.7}
    )
    assert (created.alias, created.version, created.paused) == ("policy", "1", False)
    assert created.sampling == {"t": 0.7}
    assert created.created_time == clock.now
    assert await store.get_model("policy") == created
    clock.advance(3)
    replaced = await store.put_model(
        "policy",
        [{"base_url": "http://vllm:8001/v1", "model": "qwen-2"}, {"base_url": "http://b/v1", "model": "q"}],
    )
    assert replaced.version == "2"
    assert [b.model for b in replaced.backends] == ["qwen-2", "q"]
    assert replaced.created_time == created.created_time
    assert replaced.updated_time == clock.now
    again = await store.put_model("policy", [{"base_url": "http://x/v1", "model": "q"}])
    assert again.version == "3"
    pinned = await store.put_model("policy", [{"base_url": "http://x/v1", "model": "q"}], version="ckpt-7")
    assert pinned.version == "ckpt-7"
    following = await store.put_model("policy", [{"base_url": "http://x/v1", "model": "q"}])
    assert following.version == "ckpt-8"  # the trailing number goes on, not "ckpt-7+1"
    await store.put_model("judge", [{"base_url": "https://api.example/v1", "model": "gpt"}])
    assert [m.alias for m in await store.list_models()] == ["judge", "policy"]
    paused = await store.set_model_paused("policy", True)
    assert paused.paused is True
    await store.delete_model("policy")
    with pytest.raises(NotFoundError):
        await store.get_model("policy")
    assert [m.alias for m in await store.list_models()] == ["judge"]


async def test_the_catalog_revision_moves_with_every_alias_or_key_change_and_each_call_reads_it(store: Store) -> None:
    """What replicas rely on: a call's arrival tells the revision of aliases and keys it arrived under."""
    await store.enqueue([{"input": {}}])
    [claimed] = await store.claim("w")
    rollout_id, attempt_id = claimed.rollout.rollout_id, claimed.attempt.attempt_id

    async def seen() -> tuple[int, int, int]:  # read directly, on an attributed and an unattributed arrival
        attributed = await store.begin_call(rollout_id, attempt_id)
        unattributed = await store.begin_call(None, None)
        return await store.catalog_revision(), attributed.catalog_revision, unattributed.catalog_revision

    revisions = [await seen()]
    backend = {"base_url": "http://vllm:8000/v1", "model": "qwen"}
    key, _ = await store.mint_key("gateway")
    revisions.append(await seen())  # minting a key changes nothing a replica has cached
    for change in (
        store.put_model("policy", [backend]),
        store.put_model("policy", [backend], version="v2"),  # a swap
        store.set_model_paused("policy", True),
        store.set_model_paused("policy", False),
        store.revoke_key(key.key_id),
        store.delete_model("policy"),
    ):
        await change
        revisions.append(await seen())
    with pytest.raises(NotFoundError):
        await store.delete_model("policy")  # refused: nothing changed
    await store.enqueue([{"input": {}}])  # not the catalog
    revisions.append(await seen())
    assert [r[0] for r in revisions] == [0, 0, 1, 2, 3, 4, 5, 6, 6]
    assert all(direct == attributed == unattributed for direct, attributed, unattributed in revisions)


@pytest.mark.parametrize(
    "backends",
    [
        [],
        [
            {"base_url": "http://a", "model": "m", "backend_id": "x"},
            {"base_url": "http://b", "model": "m", "backend_id": "x"},
        ],
    ],
)
async def test_invalid_model_backends_are_refused(store: Store, backends: list[dict[str, Any]]) -> None:
    with pytest.raises(StoreValidationError):
        await store.put_model("m", backends)
    assert await store.list_models() == []


async def test_an_alias_ending_in_an_action_name_is_refused(store: Store) -> None:
    backend = [{"base_url": "http://a", "model": "m"}]
    for alias in ("policy/pause", "Qwen/Qwen2.5/resume", "a/swap", "b/drain"):
        with pytest.raises(StoreValidationError, match="names an action"):
            await store.put_model(alias, backend)
    assert await store.list_models() == []
    # The words themselves, and as a part of a longer segment, are plain aliases.
    for alias in ("pause", "swap", "org/pause-v2", "pause/policy"):
        await store.put_model(alias, backend)
    assert sorted(m.alias for m in await store.list_models()) == ["org/pause-v2", "pause", "pause/policy", "swap"]


async def test_an_alias_a_url_path_cannot_carry_is_refused(store: Store) -> None:
    backend = [{"base_url": "http://a", "model": "m"}]
    for alias in ("..", ".", "../../etc", "a//b", "/lead", "trail/", "a/./b", " pad", "tab\there", "x" * 257):
        with pytest.raises(StoreValidationError, match="cannot be addressed"):
            await store.put_model(alias, backend)
    assert await store.list_models() == []
    for alias in ("Qwen/Qwen2.5-1.5B-Instruct", "meta-llama/Llama-3.1-8B@v2", "a.b", "..x", "x" * 256):
        await store.put_model(alias, backend)
    assert len(await store.list_models()) == 5


async def test_invalid_backend_is_a_pydantic_error(store: Store) -> None:
    for bad in ({"base_url": "http://a"}, {"base_url": "http://a", "model": "m", "weight": 0}):
        with pytest.raises(pydantic.ValidationError):
            await store.put_model("m", [bad])
    assert await store.list_models() == []


async def test_backend_api_key_is_a_secret_never_echoed(store: Store) -> None:
    model = await store.put_model(
        "secretive", [{"base_url": "https://api.example/v1", "model": "gpt", "api_key": SECRET}]
    )
    for shown in (model, await store.get_model("secretive"), (await store.list_models())[0]):
        key = shown.backends[0].api_key
        assert key is not None
        assert type(key).__name__ == "SecretStr"
        assert key.get_secret_value() == SECRET
        for text in (str(shown), repr(shown), shown.model_dump_json(), str(shown.model_dump())):
            assert SECRET not in text
        assert str(shown.backends[0].model_dump(mode="json")).count(SECRET) == 0


async def read_table(url: str, table: str) -> list[dict[str, Any]]:
    """Every row of ``table``, read with a plain driver on a connection of its own (not through the store)."""
    if url.startswith("sqlite:///"):
        with contextlib.closing(sqlite3.connect(url.removeprefix("sqlite:///"))) as db:
            db.row_factory = sqlite3.Row
            return [dict(row) for row in db.execute(f"SELECT * FROM {table}")]
    conn = await asyncpg.connect(url)
    try:
        return [dict(row) for row in await conn.fetch(f"SELECT * FROM {table}")]
    finally:
        await conn.close()


async def test_minted_key_is_shown_once_and_stored_as_a_digest(store: Store, migrated_url: str) -> None:
    record, plain = await store.mint_key("gateway", name="ci")
    assert plain.startswith("sk-rw-")
    assert len(plain) > 30
    assert plain not in record.model_dump_json()
    assert plain.startswith(record.prefix)
    found = await store.find_key(plain)
    assert found is not None and found.key_id == record.key_id and found.scope == "gateway"
    assert await store.find_key(plain + "x") is None
    assert await store.find_key("") is None
    rows = await read_table(migrated_url, "api_keys")
    assert len(rows) == 1
    assert rows[0]["key_hash"] == hashlib.sha256(plain.encode()).hexdigest()
    assert all(plain not in str(value) for value in rows[0].values())


async def test_revoked_key_is_not_found(store: Store, clock: FakeClock) -> None:
    record, plain = await store.mint_key("gateway")
    other, other_plain = await store.mint_key("admin")
    clock.advance(2)
    revoked = await store.revoke_key(record.key_id)
    assert revoked.revoked_time == clock.now
    assert await store.find_key(plain) is None
    found = await store.find_key(other_plain)
    assert found is not None and found.key_id == other.key_id
    # Revoking again keeps the first revocation time.
    clock.advance(2)
    assert (await store.revoke_key(record.key_id)).revoked_time == revoked.revoked_time


async def test_expired_key_is_not_found(store: Store, clock: FakeClock) -> None:
    _, plain = await store.mint_key("gateway", expires_time=clock.now + 10)
    assert await store.find_key(plain) is not None
    clock.advance(10)
    assert await store.find_key(plain) is None


async def test_rollout_key_is_bound_to_an_attempt(store: Store) -> None:
    with pytest.raises(StoreValidationError):
        await store.mint_key("rollout", rollout_id="ro-1")
    rollout_id = await enqueue_one(store)
    [claimed] = await store.claim("w1")
    record, plain = await store.mint_key("rollout", rollout_id=rollout_id, attempt_id=claimed.attempt.attempt_id)
    found = await store.find_key(plain)
    assert found is not None
    assert (found.scope, found.rollout_id, found.attempt_id) == ("rollout", rollout_id, claimed.attempt.attempt_id)
    assert record.key_id == found.key_id


async def test_claim_with_keys_mints_one_key_per_claimed_attempt(store: Store) -> None:
    await store.enqueue([{"input": {"i": i}} for i in range(3)])
    claimed = await store.claim_with_keys("w1", limit=5)
    assert len(claimed) == 3 and len({key for _, key in claimed}) == 3
    for attempted, key in claimed:
        found = await store.find_key(key)
        assert found is not None and found.scope == "rollout"
        assert (found.rollout_id, found.attempt_id) == (attempted.rollout.rollout_id, attempted.attempt.attempt_id)
    assert await store.claim_with_keys("w1") == []  # an empty queue mints nothing


def test_span_values_follow_the_spans_table_columns() -> None:
    # span_values builds insert tuples positionally: its column list must be the table's, pk aside.
    from rollway.store.db import models
    from rollway.store.sql import convert

    assert set(convert.SPAN_COLUMNS) == {c.name for c in models.spans.columns if c.name != "pk"}
    assert len(convert.SPAN_COLUMNS) == len(set(convert.SPAN_COLUMNS))


async def test_tasks_naming_a_group_without_a_size_join_it(store: Store) -> None:
    """Tasks that name a group_id and leave out group_size join that group, in one request or several (the
    CLI's batches of one file, direct starts): indexes continue, the size counts every member."""
    first = await store.enqueue([{"input": i, "group_id": "shared"} for i in range(2)] + [{"input": "alone"}])
    assert [(r.group_id, r.group_size, r.group_index) for r in first] == [
        ("shared", 2, 0),
        ("shared", 2, 1),
        (None, None, None),
    ]
    later = await store.enqueue([{"input": 2, "group_id": "shared"}, {"input": 3, "group_id": "other"}])
    assert [(r.group_id, r.group_size, r.group_index) for r in later] == [("shared", 3, 2), ("other", 1, 0)]
    started = await store.start_rollout({"input": 4, "group_id": "shared"})
    assert (started.rollout.group_size, started.rollout.group_index) == (4, 3)
    group = await store.get_group("shared")
    assert sorted(filled(r.group_index for r in group)) == [0, 1, 2, 3]
    # The same request sent again (client ids, or an idempotency key) finds its rows where they were.
    keyed = [{"input": 5, "group_id": "shared"}, {"input": 6, "group_id": "shared"}]
    once = await store.enqueue(keyed, idempotency_key="key-g")
    again = await store.enqueue(keyed, idempotency_key="key-g")
    assert [(r.rollout_id, r.group_index) for r in again] == [(r.rollout_id, r.group_index) for r in once]
    assert [r.group_index for r in once] == [4, 5]
    for mixed in (
        [{"input": 1, "group_id": "mixed", "group_size": 2}, {"input": 2, "group_id": "mixed"}],
        [{"input": 1, "group_id": "mixed", "group_size": 2}, {"input": 2, "group_id": "mixed", "group_size": 3}],
    ):
        with pytest.raises(StoreValidationError, match="group_size"):  # which would the group's size be?
            await store.enqueue(mixed)
    assert (await store.list_rollouts(group_id="mixed")).items == []


async def test_every_member_of_a_joined_group_has_its_own_index(store: Store) -> None:
    await store.enqueue([{"rollout_id": "r1", "group_id": "g"}, {"rollout_id": "r2", "group_id": "g"}])
    await store.enqueue([{"rollout_id": "r3", "group_id": "g"}, {"rollout_id": "r1", "group_id": "g"}])  # r1 again
    await store.enqueue([{"input": "sized", "group_id": "g", "group_size": 2}])  # a sized task joins too
    members = await store.get_group("g")
    assert sorted(filled(r.group_index for r in members)) == [0, 1, 2, 3, 4]
    assert max(r.group_size or 0 for r in members) == 5


async def test_a_keyed_request_that_joined_a_group_gets_its_first_answer_again(store: Store) -> None:
    """Its members' places depend on what the group had then: a retry after others joined is still the same
    request, and so is a direct start's retry."""
    await store.enqueue([{"input": 0, "group_id": "g"}])
    task = {"input": 1, "group_id": "g"}
    started = await store.start_rollout(task, worker_id="w", idempotency_key="start-1")
    assert (started.rollout.group_size, started.rollout.group_index) == (2, 1)
    again = await store.start_rollout(task, worker_id="w", idempotency_key="start-1")
    assert again.rollout.rollout_id == started.rollout.rollout_id and again.attempt == started.attempt
    pair = [{"input": 2, "group_id": "g"}, {"input": 3, "group_id": "g"}]
    first = await store.enqueue(pair, idempotency_key="enqueue-1")
    await store.enqueue([{"input": 4, "group_id": "g"}])  # someone else joins meanwhile
    retried = await store.enqueue(pair, idempotency_key="enqueue-1")
    assert [(r.rollout_id, r.group_index) for r in retried] == [(r.rollout_id, r.group_index) for r in first]
    assert sorted(filled(r.group_index for r in await store.get_group("g"))) == [0, 1, 2, 3, 4]


async def test_a_direct_start_declares_the_size_of_the_group_it_joins(store: Store) -> None:
    """An online group built one direct start at a time: each start names the group and its size, joins it at the
    next index, and the group keeps the size declared (it is complete once that many members finished)."""
    first = await store.start_rollout({"input": 0, "group_id": "online", "group_size": 3}, "w1")
    assert (first.rollout.group_id, first.rollout.group_size, first.rollout.group_index) == ("online", 3, 0)
    second = await store.start_rollout({"input": 1, "group_id": "online", "group_size": 3}, "w2")
    assert (second.rollout.group_size, second.rollout.group_index) == (3, 1)
    await store.update_attempt(first.rollout.rollout_id, status="succeeded")
    await store.update_attempt(second.rollout.rollout_id, status="succeeded")
    assert (await store.export_rollouts(ExportQuery(group_id="online"))).rollouts == []  # two of three finished
    joined = await store.start_rollout({"input": 2, "group_id": "online"}, "w3")  # no size: joins as it is
    assert (joined.rollout.group_size, joined.rollout.group_index) == (3, 2)
    for size, message in ((3, "of size 3 has 3 members: no room"), (4, "has size 3 \\(3 members\\), not 4")):
        with pytest.raises(StoreValidationError, match=message):
            await store.start_rollout({"input": 9, "group_id": "online", "group_size": size})
    members = await store.get_group("online")
    assert [(r.group_index, r.group_size) for r in members] == [(0, 3), (1, 3), (2, 3)]
    await store.update_attempt(joined.rollout.rollout_id, status="succeeded")
    exported = await store.export_rollouts(ExportQuery(group_id="online"))
    assert [r.rollout_id for r in exported.rollouts] == [r.rollout_id for r in members]

    # A group whose members joined without a size is as large as they are: a start cannot declare another.
    await store.enqueue([{"input": i, "group_id": "counted"} for i in range(2)])
    with pytest.raises(StoreValidationError, match="'counted' has size 2 \\(2 members\\), not 4"):
        await store.start_rollout({"input": 2, "group_id": "counted", "group_size": 4})
    assert len(await store.get_group("counted")) == 2


async def test_enqueued_tasks_sharing_a_group_and_its_size_are_its_members(store: Store) -> None:
    """Several tasks of one request naming a group with one group_size are one rollout each, and the size is the
    group's; a single such task still stands for group_size rollouts of its input."""
    pair = await store.enqueue(
        [{"input": "a", "group_id": "g", "group_size": 4}, {"input": "b", "group_id": "g", "group_size": 4}]
    )
    assert [(r.input, r.group_size, r.group_index) for r in pair] == [("a", 4, 0), ("b", 4, 1)]
    started = await store.start_rollout({"input": "c", "group_id": "g", "group_size": 4})
    assert (started.rollout.group_size, started.rollout.group_index) == (4, 2)
    with pytest.raises(StoreValidationError, match="'g' of size 4 has 3 members: no room for 2 more members"):
        await store.enqueue([{"input": i, "group_id": "g", "group_size": 4} for i in "de"])
    [last] = await store.enqueue([{"input": "d", "group_id": "g"}])  # joining: takes the last place
    assert (last.group_size, last.group_index) == (4, 3)
    assert sorted(filled(r.group_index for r in await store.get_group("g"))) == [0, 1, 2, 3]
    sampled = await store.enqueue([{"input": "s", "group_id": "h", "group_size": 3}])
    assert [(r.input, r.group_size, r.group_index) for r in sampled] == [("s", 3, i) for i in range(3)]


async def test_a_start_with_group_size_1_joins_the_group(store: Store) -> None:
    """``group_size: 1`` is what a start makes (one rollout), not a group of one: such starts join the group."""
    for i in range(3):
        started = await store.start_rollout({"input": i, "group_id": "loose", "group_size": 1}, "w")
        assert (started.rollout.group_index, started.rollout.group_size) == (i, i + 1)


async def test_a_keyed_start_or_enqueue_that_declared_a_size_gets_its_first_answer_again(store: Store) -> None:
    """Sent again after the group filled up, a declared member is the same request (not 'no room'); sent again
    naming another size, it is another request."""
    task = {"input": 0, "group_id": "g", "group_size": 3}
    started = await store.start_rollout(task, "w", idempotency_key="s")
    pair = [{"input": i, "group_id": "g", "group_size": 3} for i in (1, 2)]
    queued = await store.enqueue(pair, idempotency_key="e")
    assert [r.group_index for r in queued] == [1, 2]  # the group is full now
    again = await store.start_rollout(task, "w", idempotency_key="s")
    assert (again.rollout.rollout_id, again.attempt.attempt_id) == (
        started.rollout.rollout_id,
        started.attempt.attempt_id,
    )
    assert [r.rollout_id for r in await store.enqueue(pair, idempotency_key="e")] == [r.rollout_id for r in queued]
    with pytest.raises(ConflictError, match="'s' was already used for a different request"):
        await store.start_rollout({**task, "group_size": 4}, "w", idempotency_key="s")
    with pytest.raises(ConflictError, match="'e' was already used for a different request"):
        await store.enqueue([{**t, "group_size": 4} for t in pair], idempotency_key="e")
    assert len(await store.get_group("g")) == 3


async def test_a_client_rollout_id_must_leave_room_for_the_members_it_names(store: Store) -> None:
    """A task with ``group_size`` n names its n rollouts ``<rollout_id>-<i>``: those must fit 128 characters. A
    start, or a declared member (tasks sharing a group id and size), is one rollout with its own id as given."""
    [*_, last] = await store.enqueue([{"rollout_id": "r" * 126, "group_size": 10}])  # r...r-9: 128 characters
    assert last.rollout_id == "r" * 126 + "-9"
    with pytest.raises(StoreValidationError, match="too long for group_size 11"):
        await store.enqueue([{"rollout_id": "q" * 126, "group_size": 11}])  # q...q-10: 129
    started = await store.start_rollout({"rollout_id": "s" * 128, "group_id": "g", "group_size": 11}, "w")
    assert started.rollout.rollout_id == "s" * 128
    members = [{"rollout_id": c * 128, "group_id": "h", "group_size": 11} for c in "tu"]
    assert [r.rollout_id for r in await store.enqueue(members)] == ["t" * 128, "u" * 128]
