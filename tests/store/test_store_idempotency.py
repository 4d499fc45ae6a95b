"""A keyed request sent again must be the request first sent with its key: another number of tasks or spans,
or any field changed, is a conflict that writes nothing, while the same request again still gets what the
first made (tests/store/test_store_contract.py). Runs on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import pytest
from sqlalchemy import func, select

from rollway.store import ConflictError, RolloutConfig, Store, ids
from rollway.store.db import models
from rollway.store.signals import Signal
from support.store_helpers import span

if TYPE_CHECKING:
    from support.clock import FakeClock

TASKS: list[dict[str, Any]] = [
    {"input": {"q": "a"}, "metadata": {"source": "gsm8k"}, "priority": 2, "config": {"max_attempts": 2}},
    {"input": {"q": "b"}, "group_size": 3, "mode": "train"},
]


def changed(position: int, **fields: Any) -> list[dict[str, Any]]:
    tasks = [dict(t) for t in TASKS]
    tasks[position].update(fields)
    return tasks


@pytest.mark.parametrize(
    "other",
    [
        pytest.param([*TASKS, {"input": {"q": "c"}}], id="one-task-more"),
        pytest.param(TASKS[:1], id="one-task-fewer"),
        pytest.param([TASKS[0], {**TASKS[1], "rollout_id": "mine"}], id="own-id-where-a-keyed-task-was"),
        pytest.param(changed(0, config={"max_attempts": 3}), id="config"),
        pytest.param(changed(0, config=None), id="config-left-out"),
        pytest.param(changed(0, priority=0), id="priority"),
        pytest.param(changed(0, metadata={"source": "math"}), id="metadata"),
        pytest.param(changed(0, metadata=None), id="metadata-left-out"),
        pytest.param(changed(0, agent="remote"), id="agent"),
        pytest.param(changed(1, mode="val"), id="mode"),
        pytest.param(changed(1, group_size=4), id="larger-group"),
        pytest.param(changed(1, group_size=2), id="smaller-group"),
        pytest.param(changed(1, group_id="mine"), id="group-id"),
        pytest.param(changed(1, resources_id="rs-other"), id="resources"),
    ],
)
async def test_a_keyed_enqueue_sent_again_with_another_request_is_a_conflict(
    store: Store, other: list[dict[str, Any]]
) -> None:
    await store.update_resources("rs-other", {"prompt": "q"})
    await store.add_resources({"prompt": "p"})  # the latest: what tasks without resources_id get
    first = await store.enqueue(TASKS, idempotency_key="k")
    with pytest.raises(ConflictError, match="idempotency key 'k' was already used for a different request"):
        await store.enqueue(other, idempotency_key="k")
    assert [r.rollout_id for r in (await store.list_rollouts(limit=100)).items] == [r.rollout_id for r in first]
    again = await store.enqueue(TASKS, idempotency_key="k")
    assert [r.rollout_id for r in again] == [r.rollout_id for r in first]


async def test_a_keyed_enqueue_sent_again_with_its_own_id_tasks_changed_or_left_out_is_a_conflict(
    store: Store,
) -> None:
    """The digest covers every task of the request, those naming their own ``rollout_id`` too (their rows are
    not compared: a known id returns the stored rollout, whatever it holds)."""
    request: list[dict[str, Any]] = [{"input": 1}, {"rollout_id": "mine", "input": 2}]
    first = await store.enqueue(request, idempotency_key="k")
    for other in ([request[0]], [request[0], {"rollout_id": "mine", "input": 3}]):
        with pytest.raises(ConflictError, match="'k' was already used for a different request"):
            await store.enqueue(other, idempotency_key="k")
    assert await store.enqueue(request, idempotency_key="k") == first


async def test_overlapping_tries_of_one_keyed_enqueue_queue_it_once(store: Store) -> None:
    tries = await asyncio.gather(*(store.enqueue(TASKS, idempotency_key="race") for _ in range(4)))
    assert len({tuple(r.rollout_id for r in rollouts) for rollouts in tries}) == 1
    assert len((await store.list_rollouts(limit=100)).items) == 4


async def test_a_keyed_enqueue_is_compared_with_what_was_stored_not_with_the_defaults_it_fills_in(
    store: Store,
) -> None:
    first = await store.enqueue([{"input": 1, "config": {"timeout_seconds": 10}}], idempotency_key="k")
    resources = await store.add_resources({"prompt": "newer"})  # the latest moved on since the first try
    explicit = {"input": 1, "config": RolloutConfig(timeout_seconds=10.0, max_attempts=1), "priority": 0}
    [again] = await store.enqueue([explicit], idempotency_key="k")
    assert again.rollout_id == first[0].rollout_id
    assert again.resources_id is None and resources.resources_id  # as stored, not the latest of now


async def test_a_keyed_start_sent_again_with_another_field_is_a_conflict(store: Store) -> None:
    task = {"input": "q", "metadata": {"m": 1}, "priority": 1, "config": {"max_attempts": 2}, "group_id": "g"}
    first = await store.start_rollout(task, "w1", idempotency_key="s")
    for field, value in [("metadata", {"m": 2}), ("priority", 5), ("config", None), ("group_id", None)]:
        with pytest.raises(ConflictError, match="'s' was already used for a different request"):
            await store.start_rollout({**task, field: value}, "w1", idempotency_key="s")
    again = await store.start_rollout(task, "w1", idempotency_key="s")
    assert again.attempt.attempt_id == first.attempt.attempt_id
    assert len((await store.list_rollouts()).items) == 1


async def test_a_keyed_claim_sent_again_asking_for_fewer_than_it_took_is_a_conflict(store: Store) -> None:
    await store.enqueue([{"input": i} for i in range(4)])
    first = await store.claim("w1", limit=3, idempotency_key="c")
    assert len(first) == 3
    with pytest.raises(ConflictError, match="'c' was already used for a different request"):
        await store.claim("w1", limit=2, idempotency_key="c")
    again = await store.claim("w1", limit=3, idempotency_key="c")
    assert [c.attempt.attempt_id for c in again] == [c.attempt.attempt_id for c in first]


def keyed(rollout_id: str, key: str, position: int, **fields: Any) -> dict[str, Any]:
    """A span as the admin API makes it from one sent without ids: span and trace ids derive from the key."""
    return {
        **span(rollout_id, **fields),
        "span_id": ids.derived_hex(key, position, "span"),
        "trace_id": ids.derived_hex(key, position, "trace", digits=32),
    }


async def test_keyed_spans_sent_again_with_other_spans_are_a_conflict_and_write_nothing(store: Store) -> None:
    rid = (await store.start_rollout({"input": "q"}, "w1")).rollout.rollout_id
    request = [
        keyed(rid, "p", 0, name="tool", attributes={"i": 1}, start_time=1.5),
        keyed(rid, "p", 1, name="tool", status={"status_code": "OK"}),
    ]
    own = span(rid, name="own")
    first = await store.add_spans(request, idempotency_key="p")
    others: list[list[dict[str, Any]]] = [
        [*request, keyed(rid, "p", 2, name="tool")],  # one span more
        [*request, own],  # one span more, with its own id
        request[:1],  # one span fewer
        [request[0], own],  # a span with its own id where one without was
        [request[0], {**request[1], "status": {"status_code": "ERROR"}}],
        [{**request[0], "start_time": 2.0}, request[1]],
        [{**request[0], "parent_id": "abc"}, request[1]],
        [{**request[0], "sequence_id": 7}, request[1]],
        [{**request[0], "resource": {"service.name": "x"}}, request[1]],
        [{**request[0], "extra_field": 1}, request[1]],
    ]
    for other in others:
        with pytest.raises(ConflictError, match="'p' was already used for a different request"):
            await store.add_spans(other, idempotency_key="p")
    assert [s.span_id for s in await store.query_spans(rid)] == [s.span_id for s in first]
    again = await store.add_spans(request, idempotency_key="p")
    assert again == first
    # The store fills in what a request leaves out (sequence ids, the attempt); given as stored, they match.
    assert await store.add_spans([s.model_dump() for s in first], idempotency_key="p") == first


async def test_fields_the_caller_stamps_on_each_try_are_not_compared(store: Store) -> None:
    rid = (await store.start_rollout({"input": "q"}, "w1")).rollout.rollout_id
    reward = keyed(rid, "r", 0, name="rollway.reward", start_time=1.0, end_time=1.0)
    [first] = await store.add_spans([reward], idempotency_key="r", stamped=("start_time", "end_time"))
    later = {**reward, "start_time": 9.0, "end_time": 9.0}
    assert await store.add_spans([later], idempotency_key="r", stamped=("start_time", "end_time")) == [first]
    with pytest.raises(ConflictError):
        await store.add_spans([later], idempotency_key="r")


# -- what happened to the rows since: edits are not another request -----------------------------------------


async def test_a_keyed_enqueue_sent_again_after_its_rollouts_were_edited_gets_them_as_they_are(store: Store) -> None:
    await store.update_resources("rs-other", {"prompt": "q"})
    first = await store.enqueue(TASKS, idempotency_key="k")
    edits = {"input": "edited", "mode": "test", "config": {"max_attempts": 5}, "resources_id": "rs-other"}
    for rollout in first:
        await store.update_rollout(rollout.rollout_id, {**edits, "metadata": {"source": "edited"}})
    again = await store.enqueue(TASKS, idempotency_key="k")
    assert [r.rollout_id for r in again] == [r.rollout_id for r in first]
    assert {(r.input, r.metadata["source"]) for r in again if r.metadata} == {("edited", "edited")}  # as they are
    # What the rows hold now is not what the first request asked for: sent with the key, it is another request.
    with pytest.raises(ConflictError, match="'k' was already used for a different request"):
        await store.enqueue(changed(0, metadata={"source": "edited"}), idempotency_key="k")
    assert len((await store.list_rollouts(limit=100)).items) == 4


async def test_a_keyed_start_sent_again_after_its_rollout_and_attempt_were_edited_gets_them(store: Store) -> None:
    task = {"input": "q", "metadata": {"m": 1}, "config": {"max_attempts": 2}}
    first = await store.start_rollout(task, "w1", idempotency_key="s")
    rid = first.rollout.rollout_id
    await store.update_rollout(rid, {"metadata": {"m": 2}, "input": "edited"})
    await store.update_attempt(rid, worker_id="w2")
    again = await store.start_rollout(task, "w1", idempotency_key="s")
    assert (again.rollout.rollout_id, again.attempt.attempt_id) == (rid, first.attempt.attempt_id)
    assert (again.rollout.metadata, again.attempt.worker_id) == ({"m": 2}, "w2")
    for other, worker in (({**task, "metadata": {"m": 2}}, "w1"), (task, "w2")):
        with pytest.raises(ConflictError, match="'s' was already used for a different request"):
            await store.start_rollout(other, worker, idempotency_key="s")


async def test_a_keyed_new_attempt_sent_again_after_its_worker_was_changed_gets_it(store: Store) -> None:
    rid = (await store.start_rollout({"input": "q"}, "w1")).rollout.rollout_id
    second = await store.start_attempt(rid, "w1", idempotency_key="a")
    await store.update_attempt(rid, second.attempt.attempt_id, worker_id="w2")
    again = await store.start_attempt(rid, "w1", idempotency_key="a")
    assert (again.attempt.attempt_id, again.attempt.worker_id) == (second.attempt.attempt_id, "w2")
    assert again.rollout.attempt_count == 2
    with pytest.raises(ConflictError, match="'a' was already used for a different request"):
        await store.start_attempt(rid, "w2", idempotency_key="a")  # the worker it has now did not ask for it


async def test_a_keyed_claim_sent_again_after_its_worker_was_changed_gets_it(store: Store) -> None:
    await store.enqueue([{"input": i} for i in range(3)])
    first = await store.claim("w1", limit=2, idempotency_key="c")
    await store.update_attempt(first[0].rollout.rollout_id, worker_id="w2")
    again = await store.claim("w1", limit=2, idempotency_key="c")
    assert [c.attempt.attempt_id for c in again] == [c.attempt.attempt_id for c in first]
    assert again[0].attempt.worker_id == "w2"
    with pytest.raises(ConflictError, match="'c' was already used by another worker's claim"):
        await store.claim("w2", limit=2, idempotency_key="c")


# -- the gateway keys of an answer given again -----------------------------------------------------------------


async def live_keys(store: Store, attempt_id: str) -> int:
    keys = models.api_keys
    query = select(func.count()).where(keys.c.attempt_id == attempt_id, keys.c.revoked_time.is_(None))
    return int(await store.read(lambda conn: conn.execute(query).scalar_one()))


async def test_a_keyed_claim_answered_again_leaves_one_live_key_the_last_answers(
    store: Store, clock: FakeClock
) -> None:
    await store.enqueue([{"input": i} for i in range(2)])
    first = await store.claim_with_keys("w1", limit=2, idempotency_key="c")
    clock.advance(1.0)  # the answer was lost; the client sends the claim again
    again = await store.claim_with_keys("w1", limit=2, idempotency_key="c")
    assert [c.attempt.attempt_id for c, _ in again] == [c.attempt.attempt_id for c, _ in first]
    for (claimed, lost), (_, key) in zip(first, again, strict=True):
        assert lost != key and await store.find_key(lost) is None  # only a hash is kept: the lost key is revoked
        found = await store.find_key(key)
        assert found is not None and found.attempt_id == claimed.attempt.attempt_id
        assert await live_keys(store, claimed.attempt.attempt_id) == 1


async def test_overlapping_tries_of_a_keyed_claim_revoke_neither_answers_key(
    store: Store, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two tries of one claim wait for work together (the client gave up on the first, whose server side still
    waits): the one that finds the other's claim must not revoke the key the other answered with — the client
    may hold that answer. Only keys minted before a try arrived are revoked."""
    waiting: set[asyncio.Task[Any] | None] = set()  # the tries that found no work and wait for some
    changed = asyncio.Event()
    original = Signal.wait

    async def wait(generation: asyncio.Event, timeout: float) -> None:
        waiting.add(asyncio.current_task())
        changed.set()
        await original(generation, timeout)

    monkeypatch.setattr(Signal, "wait", staticmethod(wait))
    tries = []
    for _ in range(2):
        tries.append(asyncio.create_task(store.claim_with_keys("w1", wait_seconds=10, idempotency_key="c")))
        while tries[-1] not in waiting:
            changed.clear()
            await asyncio.wait_for(changed.wait(), 10)
        clock.advance(1.0)
    await store.enqueue([{"input": 1}])
    answers = await asyncio.gather(*tries)
    assert len({claimed.attempt.attempt_id for [(claimed, _)] in answers}) == 1
    assert all([await store.find_key(key) is not None for [(_, key)] in answers])
