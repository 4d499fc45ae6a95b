"""An LLM call in flight is a heartbeat (every span is a heartbeat, docs/store.md; a call's span is only written
when it ends, so the attempt is kept alive while the call runs: ``store/parts/keepalive.py``). End to end: a real
gateway, the mock backend answering slowly, a watchdog sweeping every 0.1 s. Then the store's side, on SQLite
and PostgreSQL: which attempts a round touches, how, and that it writes nothing without a long call."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import asyncpg
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from rollway.mock import MockBackendProcess
from rollway.store import AttemptStatus, RolloutConfig, RolloutStatus, Span, Store
from rollway.store.sql import keepalive
from rollway.store.sql.calls import CallTicket
from support.gateway_harness import RunningGateway, register, running_gateway, vllm
from support.store_helpers import enqueue_one, span, waiting_for_a_lock

if TYPE_CHECKING:
    from support.clock import FakeClock

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Think for a long time."}]
RETRY_UNRESPONSIVE = {"max_attempts": 2, "retry_condition": ["unresponsive", "timeout"]}


async def claimed(gw: RunningGateway, mock: MockBackendProcess, config: dict[str, Any]) -> tuple[str, str]:
    """A rollout with ``config``, claimed once the gateway's client is ready (the first request of a new client
    takes a while, which would count against the attempt's limits)."""
    await register(gw.store, "policy", vllm(mock))
    [rollout] = await gw.store.enqueue([{"input": {"task": "t"}, "config": config}])
    await gw.client().models.list()
    [claim] = await gw.store.claim("worker-1")
    return rollout.rollout_id, claim.attempt.attempt_id


async def watch(store: Store, rollout_id: str, attempt_id: str, until: asyncio.Task[Any]) -> set[tuple[str, str]]:
    """Every (rollout status, attempt status) seen while ``until`` runs, read every 50 ms."""
    seen: set[tuple[str, str]] = set()
    while not until.done():
        rollout = await store.get_rollout(rollout_id, with_attempts=True)
        [attempt] = [a for a in rollout.attempts or [] if a.attempt_id == attempt_id]
        seen.add((rollout.status.value, attempt.status.value))
        await asyncio.sleep(0.05)
    return seen


def slow_call(gw: RunningGateway, rollout_id: str, seconds: float, attempt_id: str | None = None) -> asyncio.Task[Any]:
    """A call of the rollout (its latest attempt, or ``attempt_id``) that the backend answers ``seconds`` late."""
    [client] = gw.clients
    ids = {"X-Rollout-Id": rollout_id, **({"X-Attempt-Id": attempt_id} if attempt_id else {})}
    body = {"mock": {"latency_ms": seconds * 1000}}
    return asyncio.create_task(
        client.chat.completions.create(
            model="policy", messages=MESSAGES, max_tokens=8, extra_body=body, extra_headers=ids
        )
    )


async def test_a_call_in_flight_keeps_its_attempt_running_and_its_rollout_out_of_the_queue(
    tmp_path: Path, mock: MockBackendProcess
) -> None:
    """The audit's case (unresponsive_seconds 1.5, one 4 s call; 2.5 here, for a loaded machine's sake): the
    attempt went ``unresponsive`` and the rollout ``requeuing`` (claimable by another worker) during the call;
    now it stays running throughout."""
    async with running_gateway(tmp_path, watchdog_interval=0.1) as gw:
        rollout_id, attempt_id = await claimed(gw, mock, {"unresponsive_seconds": 2.5, **RETRY_UNRESPONSIVE})
        call = slow_call(gw, rollout_id, 4.0)
        seen = await watch(gw.store, rollout_id, attempt_id, call)
        assert (await call).choices[0].message.content
        assert seen <= {("preparing", "preparing"), ("running", "running")}, seen
        assert ("running", "running") in seen  # the first call in flight moved it on, as its span would
        assert await gw.store.claim("worker-2") == []
        attempts = await gw.store.list_attempts(rollout_id)
        assert [(a.attempt_id, a.status) for a in attempts] == [(attempt_id, AttemptStatus.RUNNING)]


async def test_streamed_calls_in_flight_keep_the_attempt_alive_too(tmp_path: Path, mock: MockBackendProcess) -> None:
    async with running_gateway(tmp_path, watchdog_interval=0.1) as gw:
        rollout_id, attempt_id = await claimed(gw, mock, {"unresponsive_seconds": 2.5, **RETRY_UNRESPONSIVE})
        [client] = gw.clients

        async def stream() -> str:
            slow = {"mock": {"ttft_ms": 1000, "token_delay_ms": 300}, "ignore_eos": True}
            events = await client.chat.completions.create(
                model="policy",
                messages=MESSAGES,
                max_tokens=10,
                stream=True,
                extra_body=slow,
                extra_headers={"X-Rollout-Id": rollout_id},
            )
            return "".join([(e.choices[0].delta.content or "") async for e in events if e.choices])

        call = asyncio.create_task(stream())
        seen = await watch(gw.store, rollout_id, attempt_id, call)
        assert await call
        assert {attempt for _, attempt in seen} <= {"preparing", "running"}, seen


async def test_the_keepalive_stops_when_the_call_ends(tmp_path: Path, mock: MockBackendProcess) -> None:
    """After the call, the attempt's liveness is its own business again: no touch keeps it alive, and the
    watchdog marks a silent attempt ``unresponsive`` as before."""
    async with running_gateway(tmp_path, watchdog_interval=0.1) as gw:
        rollout_id, attempt_id = await claimed(gw, mock, {"unresponsive_seconds": 1.5, **RETRY_UNRESPONSIVE})
        await slow_call(gw, rollout_id, 2.0)
        after = (await gw.store.get_attempt(rollout_id, attempt_id)).last_heartbeat_time
        [call_span] = await gw.store.query_spans(rollout_id)
        assert after is not None and call_span.end_time is not None and after >= call_span.end_time
        await asyncio.sleep(0.7)  # rounds every 0.5 s: one would have come
        attempt = await gw.store.get_attempt(rollout_id, attempt_id)
        assert (attempt.status, attempt.last_heartbeat_time) == (AttemptStatus.RUNNING, after)  # not touched since
        [retry] = await gw.store.claim("worker-2", wait_seconds=5)  # silent: requeued, and claimed again
        assert retry.rollout.rollout_id == rollout_id and retry.attempt.sequence_id == 2
        assert (await gw.store.get_attempt(rollout_id, attempt_id)).status == AttemptStatus.UNRESPONSIVE


async def test_a_call_in_flight_does_not_extend_the_rollout_deadline(tmp_path: Path, mock: MockBackendProcess) -> None:
    """timeout_seconds bounds the attempt from its start, calls or not: the call is cut at the deadline (504),
    the watchdog times the attempt out and the rollout is retried; nothing revives a timed-out attempt."""
    async with running_gateway(tmp_path, watchdog_interval=0.1) as gw:
        rollout_id, attempt_id = await claimed(gw, mock, {"timeout_seconds": 1.5, **RETRY_UNRESPONSIVE})
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as refused:
            await slow_call(gw, rollout_id, 4.0)
        assert refused.value.status_code == 504 and time.monotonic() - started < 3.0
        [retry] = await gw.store.claim("worker-2", wait_seconds=5)
        assert retry.rollout.rollout_id == rollout_id and retry.attempt.sequence_id == 2
        assert (await gw.store.get_attempt(rollout_id, attempt_id)).status == AttemptStatus.TIMEOUT


async def test_a_call_to_a_replaced_attempt_keeps_nothing_alive(tmp_path: Path, mock: MockBackendProcess) -> None:
    """A newer attempt replaced the one the call belongs to: the old attempt is stale and left as it is (the
    call's own span still lands on it, as before), the new one is not kept alive by a call that is not its."""
    async with running_gateway(tmp_path, watchdog_interval=0.1) as gw:
        rollout_id, old = await claimed(gw, mock, {"unresponsive_seconds": 1.5, "max_attempts": 3})
        sent = (await asyncio.to_thread(mock.stats))["requests_total"]
        call = slow_call(gw, rollout_id, 3.0, old)
        await asyncio.to_thread(mock.stats, wait_requests=sent + 1, timeout=10)  # at the backend: admitted as old's
        new = (await gw.store.start_attempt(rollout_id, "worker-2")).attempt.attempt_id
        seen = await watch(gw.store, rollout_id, new, call)
        await call
        assert (RolloutStatus.FAILED.value, AttemptStatus.UNRESPONSIVE.value) in seen, seen  # nobody kept it alive
        stale = await gw.store.get_attempt(rollout_id, old)
        assert (stale.status, stale.last_heartbeat_time) == (AttemptStatus.PREPARING, None)  # its span revives nothing


# -- the store's side (SQLite and PostgreSQL): which attempts a call in flight keeps alive, and how --------------


@pytest.fixture
async def quiet(store_url: str, clock: FakeClock) -> AsyncIterator[Store]:
    """A store whose loops are off: the tests run the rounds (``keep_alive``) and the sweeps themselves."""
    opened = await Store.open(store_url, clock=clock, run_watchdog=False, keepalive_interval=0)
    try:
        yield opened
    finally:
        await opened.close()


async def started(store: Store, **config: Any) -> tuple[str, str]:
    rollout_id = await enqueue_one(store, input={"q": 1}, config=RolloutConfig(**config))
    [claim] = await store.claim("w1")
    return rollout_id, claim.attempt.attempt_id


async def states(store: Store, rollout_id: str, attempt_id: str) -> tuple[str, str, float | None]:
    rollout = await store.get_rollout(rollout_id)
    attempt = await store.get_attempt(rollout_id, attempt_id)
    return rollout.status.value, attempt.status.value, attempt.last_heartbeat_time


def call_span(ticket: CallTicket) -> Span:
    return Span.model_validate(span(ticket.rollout_id, ticket.attempt_id, sequence_id=ticket.sequence_id))


async def test_a_call_in_flight_is_a_heartbeat_for_its_attempt_until_its_span_is_written(
    quiet: Store, clock: FakeClock
) -> None:
    rollout_id, attempt_id = await started(quiet, unresponsive_seconds=10, max_attempts=2)
    ticket = await quiet.begin_call(rollout_id, attempt_id)
    writes = quiet.writer.stats.transactions
    assert await quiet.calls_in_flight.keep_alive(min_age=60) == 0  # no call that old: nothing written
    assert quiet.writer.stats.transactions == writes
    clock.advance(8)
    # The first call of a preparing attempt moves it (and its rollout) to running, as its span will.
    assert await quiet.calls_in_flight.keep_alive(min_age=0) == 1
    assert await states(quiet, rollout_id, attempt_id) == ("running", "running", clock.now)
    clock.advance(8)
    assert await quiet.calls_in_flight.keep_alive(min_age=0) == 1  # the one statement of running attempts
    assert await states(quiet, rollout_id, attempt_id) == ("running", "running", clock.now)
    clock.advance(8)  # 24 s after the start, 8 after the last heartbeat
    assert await quiet.sweep(force=True) == 0
    await quiet.record_call(call_span(ticket))
    assert quiet.calls_in_flight.calls == {}
    writes = quiet.writer.stats.transactions
    assert await quiet.calls_in_flight.keep_alive(min_age=0) == 0  # the call ended: nothing more to keep alive
    assert quiet.writer.stats.transactions == writes
    clock.advance(11)
    assert await quiet.sweep(force=True) == 1
    assert await states(quiet, rollout_id, attempt_id) == ("failed", "unresponsive", clock.now - 11)


async def test_a_call_in_flight_revives_its_unresponsive_attempt_before_another_worker_claims_it(
    quiet: Store, clock: FakeClock
) -> None:
    retried = {"max_attempts": 2, "retry_condition": ["unresponsive"]}
    rollout_id, attempt_id = await started(quiet, unresponsive_seconds=10, **retried)
    await quiet.begin_call(rollout_id, attempt_id)
    clock.advance(11)  # (a round that came too late: the process stalled, the store was locked)
    assert await quiet.sweep(force=True) == 1
    assert (await states(quiet, rollout_id, attempt_id))[:2] == ("requeuing", "unresponsive")
    assert await quiet.calls_in_flight.keep_alive(min_age=0) == 1
    assert await states(quiet, rollout_id, attempt_id) == ("running", "running", clock.now)
    assert await quiet.claim("w2") == []  # out of the queue again


async def test_a_call_in_flight_does_not_extend_the_deadline_nor_revive_what_ended(
    quiet: Store, clock: FakeClock
) -> None:
    timed_id, timed_attempt = await started(quiet, timeout_seconds=10, max_attempts=2, retry_condition=["timeout"])
    failed_id, failed_attempt = await started(quiet, unresponsive_seconds=5)  # no retry: the rollout fails
    cancelled_id, cancelled_attempt = await started(quiet)
    done_id, done_attempt = await started(quiet)
    for rollout_id, attempt_id in [(timed_id, timed_attempt), (failed_id, failed_attempt)]:
        await quiet.begin_call(rollout_id, attempt_id)
    for rollout_id, attempt_id in [(cancelled_id, cancelled_attempt), (done_id, done_attempt)]:
        await quiet.add_span(span(rollout_id, attempt_id))  # running
        await quiet.begin_call(rollout_id, attempt_id)
    await quiet.cancel(cancelled_id)
    await quiet.update_attempt(done_id, done_attempt, status="succeeded")
    clock.advance(4)
    assert await quiet.calls_in_flight.keep_alive(min_age=0) == 2  # the timed one and the one that fails later
    clock.advance(4)
    assert await quiet.calls_in_flight.keep_alive(min_age=0) == 2
    clock.advance(3)  # 11 s after the start, 3 after the last heartbeat
    assert await quiet.sweep(force=True) == 1
    assert (await states(quiet, timed_id, timed_attempt))[:2] == ("requeuing", "timeout")
    clock.advance(3)  # failed_id: 6 s without a round
    assert await quiet.sweep(force=True) == 1
    before = [await states(quiet, r, a) for r, a in [(timed_id, timed_attempt), (failed_id, failed_attempt)]]
    assert [s[:2] for s in before] == [("requeuing", "timeout"), ("failed", "unresponsive")]
    before += [await states(quiet, r, a) for r, a in [(cancelled_id, cancelled_attempt), (done_id, done_attempt)]]
    clock.advance(1)
    assert await quiet.calls_in_flight.keep_alive(min_age=0) == 0
    after = [
        await states(quiet, r, a)
        for r, a in [
            (timed_id, timed_attempt),
            (failed_id, failed_attempt),
            (cancelled_id, cancelled_attempt),
            (done_id, done_attempt),
        ]
    ]
    assert after == before
    assert [s[:2] for s in after[2:]] == [("cancelled", "running"), ("succeeded", "succeeded")]


async def test_a_call_to_a_replaced_attempt_keeps_neither_attempt_alive(quiet: Store, clock: FakeClock) -> None:
    rollout_id, old = await started(quiet, unresponsive_seconds=10, max_attempts=3)
    await quiet.begin_call(rollout_id, old)
    await quiet.add_span(span(rollout_id, old))  # the old attempt runs
    new = (await quiet.start_attempt(rollout_id, "w2")).attempt.attempt_id
    clock.advance(1)
    assert await quiet.calls_in_flight.keep_alive(min_age=0) == 0
    assert await states(quiet, rollout_id, old) == ("preparing", "running", clock.now - 1)
    assert (await quiet.get_attempt(rollout_id, new)).last_heartbeat_time is None


async def test_each_process_keeps_its_own_calls_attempts_alive(
    quiet: Store, store_url: str, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two processes on one database: each round touches the attempts of its own calls, many in one statement
    (in chunks: here of 2)."""
    monkeypatch.setattr(keepalive, "CHUNK", 2)
    other = await Store.open(store_url, clock=clock, run_watchdog=False, keepalive_interval=0)
    try:
        ours = [await started(quiet, unresponsive_seconds=10) for _ in range(5)]
        theirs = await started(quiet, unresponsive_seconds=10)
        for rollout_id, attempt_id in ours:
            await quiet.add_span(span(rollout_id, attempt_id))  # running: the one-statement case
            await quiet.begin_call(rollout_id, attempt_id)
            await quiet.begin_call(rollout_id, attempt_id)  # two calls of one attempt: one heartbeat
        await other.begin_call(*theirs)
        clock.advance(5)
        assert await quiet.calls_in_flight.keep_alive(min_age=0) == 5
        assert {(await states(quiet, *ids))[2] for ids in ours} == {clock.now}
        assert (await states(quiet, *theirs))[2] is None
        clock.advance(1)
        assert await other.calls_in_flight.keep_alive(min_age=0) == 1
        assert (await states(quiet, *theirs))[2] == clock.now
        assert {(await states(quiet, *ids))[2] for ids in ours} == {clock.now - 1}
    finally:
        await other.close()


async def test_the_loop_writes_only_while_a_call_has_been_in_flight_for_an_interval(store_url: str) -> None:
    # The interval is well above a short call's duration on a loaded machine (a call that outlived it would be
    # written for, rightly), and the waits are a few intervals long.
    async with await Store.open(store_url, run_watchdog=False, keepalive_interval=0.25) as store:
        rollout_id, attempt_id = await started(store, unresponsive_seconds=10)
        writes = store.writer.stats.transactions
        for _ in range(5):  # short calls
            await store.record_call(call_span(await store.begin_call(rollout_id, attempt_id)))
        await asyncio.sleep(0.6)
        # Each call's own two, nothing more; on PostgreSQL the first span's move of the attempt to running is a
        # transaction of its own (``Store._record_direct``).
        own = 10 + (1 if store.direct_calls else 0)
        assert store.writer.stats.transactions == writes + own
        ticket = await store.begin_call(rollout_id, attempt_id)
        # Rounds once the call is older than 0.25 s (a round's timing is the loop's: waited for, not slept out).
        async with asyncio.timeout(15):
            while store.writer.stats.transactions < writes + own + 1 + 2:  # noqa: ASYNC110 (the loop's writes)
                await asyncio.sleep(0.05)
        assert (await store.get_attempt(rollout_id, attempt_id)).status == AttemptStatus.RUNNING
        await store.record_call(call_span(ticket))
        writes = await settled(store)
        await asyncio.sleep(0.6)
        assert store.writer.stats.transactions == writes


async def settled(store: Store) -> int:
    """How many transactions were committed, once no write is in flight: on PostgreSQL writes run side by side, so
    a round that took the call before its span was written may still be committing after ``record_call``."""
    async with asyncio.timeout(10):
        while store.writer.waiting_since() is not None:  # noqa: ASYNC110 (another task's writes: no event of theirs)
            await asyncio.sleep(0.01)
    return store.writer.stats.transactions


@pytest.mark.postgres
async def test_a_stale_attempts_call_locks_nothing_of_its_rollout(pg_url: str, clock: FakeClock) -> None:
    """PostgreSQL: a round holds the running attempt it touched; were it then to lock the rollout for another
    call's stale attempt, a lifecycle write holding that rollout (it locks rollout, then attempt) and waiting
    for the attempt would deadlock with it. The stale attempt is left out before any lock is taken."""
    store = await Store.open(pg_url, clock=clock, run_watchdog=False, keepalive_interval=0)
    try:
        rollout_id, old = await started(store, unresponsive_seconds=10, max_attempts=3)
        await store.begin_call(rollout_id, old)
        new = (await store.start_attempt(rollout_id, "w2")).attempt.attempt_id
        await store.add_span(span(rollout_id, new))  # the new attempt runs
        await store.begin_call(rollout_id, new)
        holder = await asyncpg.connect(pg_url)
        try:
            async with holder.transaction():
                await holder.execute("SELECT 1 FROM rollouts WHERE rollout_id = $1 FOR UPDATE", rollout_id)
                touched = await asyncio.wait_for(store.calls_in_flight.keep_alive(min_age=0), 10)
        finally:
            await holder.close()
        assert touched == 1
        assert (await store.get_attempt(rollout_id, new)).last_heartbeat_time == clock.now
    finally:
        await store.close()


@pytest.mark.postgres
async def test_a_round_holds_no_attempt_while_it_waits_for_a_rollout(pg_url: str, clock: FakeClock) -> None:
    """PostgreSQL: a round touches the running attempts it can (``SKIP LOCKED``) and gives the others a span's
    heartbeat, which locks their rollout first. Were the touched attempts still held while it waits for such a
    rollout, a writer holding that rollout and then asking for one of them would deadlock with it: a sweep
    (rollouts, then their attempts) or another replica's round (rollout, attempt in turn) — PostgreSQL breaks it
    after a second, with every call of those rollouts waiting behind. Seen: 9 deadlocks in one 28 s run of two
    replicas. The heartbeats that lock rollouts come after the touched attempts are committed."""
    store = await Store.open(pg_url, clock=clock, run_watchdog=False, keepalive_interval=0)
    try:
        running, running_attempt = await started(store, unresponsive_seconds=10)
        await store.add_span(span(running, running_attempt))
        await store.begin_call(running, running_attempt)  # touched in place
        preparing, preparing_attempt = await started(store, unresponsive_seconds=10)
        await store.begin_call(preparing, preparing_attempt)  # its first call: the heartbeat of a span
        holder = await asyncpg.connect(pg_url)
        try:
            async with holder.transaction():
                await holder.execute("SELECT 1 FROM rollouts WHERE rollout_id = $1 FOR UPDATE", preparing)
                round_ = asyncio.create_task(store.calls_in_flight.keep_alive(min_age=0))
                while not await waiting_for_a_lock(holder):
                    assert not round_.done(), round_
                    await asyncio.sleep(0.01)
                # The round waits for the rollout; the attempt it touched is free (NOWAIT: no deadlock to detect).
                await holder.execute("SELECT 1 FROM attempts WHERE attempt_id = $1 FOR UPDATE NOWAIT", running_attempt)
            assert await asyncio.wait_for(round_, 10) == 2
        finally:
            await holder.close()
        assert (await states(store, preparing, preparing_attempt))[:2] == ("running", "running")
    finally:
        await store.close()
