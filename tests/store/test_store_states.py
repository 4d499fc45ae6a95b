"""Store contract: status transitions of attempts and rollouts, exactly as Agent-lightning's "Understanding Store" and
docs/store.md describe them (claim/start -> preparing, first span -> running, runner outcomes, watchdog
timeout/unresponsive, retries, staleness, revival, cancellation). Runs on SQLite and PostgreSQL."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from rollway.store import AttemptedRollout, AttemptStatus, ConflictError, RolloutConfig, RolloutStatus, Store
from rollway.store.db import dialect
from rollway.store.sql import watchdog
from support.store_helpers import enqueue_one, span

if TYPE_CHECKING:
    from support.clock import FakeClock


async def claim_one(store: Store, worker_id: str = "w1") -> AttemptedRollout:
    claimed = await store.claim(worker_id)
    assert len(claimed) == 1, claimed
    return claimed[0]


async def claimed_rollout(store: Store, config: RolloutConfig | None = None) -> AttemptedRollout:
    rollout_id = await enqueue_one(store, input={"q": 1}, config=config)
    claimed = await claim_one(store)
    assert claimed.rollout.rollout_id == rollout_id
    return claimed


# -- attempt creation: claim, start_rollout, start_attempt ---------------------------------------------


async def test_enqueued_rollout_is_queuing_without_attempts(store: Store, clock: FakeClock) -> None:
    rollout_id = await enqueue_one(store, input="x")
    rollout = await store.get_rollout(rollout_id, with_attempts=True)
    assert rollout.status == RolloutStatus.QUEUING
    assert rollout.attempt_count == 0
    assert rollout.attempts == []
    assert rollout.start_time == clock.now
    assert rollout.end_time is None


async def test_claim_creates_preparing_attempt_and_preparing_rollout(store: Store, clock: FakeClock) -> None:
    rollout_id = await enqueue_one(store, input={"q": 1})
    clock.advance(5)
    claimed = await claim_one(store, "worker-a")
    assert claimed.rollout.status == RolloutStatus.PREPARING
    assert claimed.attempt.status == AttemptStatus.PREPARING
    assert claimed.attempt.sequence_id == 1
    assert claimed.attempt.worker_id == "worker-a"
    assert claimed.attempt.start_time == clock.now
    assert claimed.attempt.last_heartbeat_time is None
    stored = await store.get_rollout(rollout_id)
    assert stored.status == RolloutStatus.PREPARING
    assert stored.attempt_count == 1
    attempt = await store.get_attempt(rollout_id)
    assert attempt.attempt_id == claimed.attempt.attempt_id
    assert attempt.status == AttemptStatus.PREPARING


async def test_start_rollout_skips_the_queue_with_a_preparing_attempt(store: Store) -> None:
    started = await store.start_rollout({"input": {"q": 2}}, worker_id="w9")
    assert started.rollout.status == RolloutStatus.PREPARING
    assert started.attempt.status == AttemptStatus.PREPARING
    assert started.attempt.sequence_id == 1
    stored = await store.get_rollout(started.rollout.rollout_id)
    assert stored.status == RolloutStatus.PREPARING
    assert stored.attempt_count == 1
    assert await store.claim("w2") == []


async def test_start_attempt_on_a_queued_rollout_takes_it_out_of_the_queue(store: Store) -> None:
    rollout_id = await enqueue_one(store)
    started = await store.start_attempt(rollout_id, worker_id="w1")
    assert started.attempt.status == AttemptStatus.PREPARING
    assert started.attempt.sequence_id == 1
    assert (await store.get_rollout(rollout_id)).status == RolloutStatus.PREPARING
    assert await store.claim("w2") == []


async def test_start_attempt_on_a_running_rollout_makes_a_new_latest_attempt(store: Store) -> None:
    first = await claimed_rollout(store)
    rollout_id = first.rollout.rollout_id
    await store.add_span(span(rollout_id, first.attempt.attempt_id))
    second = await store.start_attempt(rollout_id)
    assert second.attempt.sequence_id == 2
    assert second.attempt.attempt_id != first.attempt.attempt_id
    rollout = await store.get_rollout(rollout_id)
    assert rollout.status == RolloutStatus.PREPARING
    assert rollout.attempt_count == 2
    assert (await store.get_attempt(rollout_id)).attempt_id == second.attempt.attempt_id


# -- first span -> running -------------------------------------------------------------------------------


async def test_first_span_moves_attempt_and_rollout_to_running(store: Store, clock: FakeClock) -> None:
    claimed = await claimed_rollout(store)
    rollout_id, attempt_id = claimed.rollout.rollout_id, claimed.attempt.attempt_id
    clock.advance(3)
    written = await store.add_span(span(rollout_id, attempt_id))
    assert written is not None
    attempt = await store.get_attempt(rollout_id, attempt_id)
    assert attempt.status == AttemptStatus.RUNNING
    assert attempt.last_heartbeat_time == clock.now
    assert (await store.get_rollout(rollout_id)).status == RolloutStatus.RUNNING


async def test_later_spans_keep_running_and_refresh_the_heartbeat(store: Store, clock: FakeClock) -> None:
    claimed = await claimed_rollout(store)
    rollout_id = claimed.rollout.rollout_id
    await store.add_span(span(rollout_id))
    clock.advance(7)
    await store.add_span(span(rollout_id))
    attempt = await store.get_attempt(rollout_id)
    assert attempt.status == AttemptStatus.RUNNING
    assert attempt.last_heartbeat_time == clock.now
    assert (await store.get_rollout(rollout_id)).status == RolloutStatus.RUNNING


async def test_heartbeat_moves_a_preparing_attempt_to_running(store: Store, clock: FakeClock) -> None:
    claimed = await claimed_rollout(store)
    rollout_id = claimed.rollout.rollout_id
    clock.advance(2)
    attempt = await store.heartbeat(rollout_id, claimed.attempt.attempt_id)
    assert attempt.status == AttemptStatus.RUNNING
    assert attempt.last_heartbeat_time == clock.now
    assert (await store.get_rollout(rollout_id)).status == RolloutStatus.RUNNING


# -- runner outcomes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_span", [False, True], ids=["from-preparing", "from-running"])
@pytest.mark.parametrize(
    ("outcome", "rollout_status"),
    [(AttemptStatus.SUCCEEDED, RolloutStatus.SUCCEEDED), (AttemptStatus.FAILED, RolloutStatus.FAILED)],
)
async def test_update_attempt_outcome_finishes_the_rollout_with_end_time(
    store: Store,
    clock: FakeClock,
    outcome: AttemptStatus,
    rollout_status: RolloutStatus,
    with_span: bool,
) -> None:
    claimed = await claimed_rollout(store)
    rollout_id, attempt_id = claimed.rollout.rollout_id, claimed.attempt.attempt_id
    if with_span:
        await store.add_span(span(rollout_id, attempt_id))
    clock.advance(12)
    attempt = await store.update_attempt(rollout_id, attempt_id, status=outcome)
    assert attempt.status == outcome
    assert attempt.end_time == clock.now
    rollout = await store.get_rollout(rollout_id)
    assert rollout.status == rollout_status
    assert rollout.end_time == clock.now
    assert await store.claim("w2") == []


async def test_update_attempt_latest_addresses_the_latest_attempt(store: Store) -> None:
    claimed = await claimed_rollout(store)
    rollout_id = claimed.rollout.rollout_id
    attempt = await store.update_attempt(rollout_id, "latest", status="succeeded", metadata={"reward": 1.0})
    assert attempt.attempt_id == claimed.attempt.attempt_id
    assert attempt.metadata == {"reward": 1.0}
    assert (await store.get_rollout(rollout_id)).status == RolloutStatus.SUCCEEDED


async def test_update_attempt_metadata_only_keeps_the_status(store: Store) -> None:
    claimed = await claimed_rollout(store)
    rollout_id = claimed.rollout.rollout_id
    attempt = await store.update_attempt(rollout_id, metadata={"note": "hi"})
    assert attempt.status == AttemptStatus.PREPARING
    assert attempt.metadata == {"note": "hi"}
    assert (await store.get_rollout(rollout_id)).status == RolloutStatus.PREPARING


async def test_repeating_the_same_outcome_is_a_no_op(store: Store, clock: FakeClock) -> None:
    claimed = await claimed_rollout(store)
    rollout_id = claimed.rollout.rollout_id
    await store.update_attempt(rollout_id, status="succeeded")
    ended = (await store.get_rollout(rollout_id)).end_time
    clock.advance(10)
    attempt = await store.update_attempt(rollout_id, status="succeeded")
    assert attempt.status == AttemptStatus.SUCCEEDED
    assert (await store.get_rollout(rollout_id)).end_time == ended


# -- watchdog: timeout and unresponsive ----------------------------------------------------------------------


async def test_a_sweep_locks_only_the_rollouts_it_ends(
    store: Store, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Of three live rollouts — one past its timeout, one within it, one with no limits — the sweep locks the
    first only: it reads them all, and locks what it found due (calls of the others are not held up)."""
    due, within, unlimited = await store.enqueue(
        [
            {"input": 0, "config": {"timeout_seconds": 10}},
            {"input": 1, "config": {"timeout_seconds": 1000}},
            {"input": 2},
        ]
    )
    await store.claim("w", limit=3)
    locked: list[str] = []
    original = dialect.lock_rows  # the one watchdog imports and calls

    def recording(stmt: Any, conn: Any, **kwargs: Any) -> Any:
        params = stmt.compile(dialect=conn.dialect, compile_kwargs={"render_postcompile": True}).params
        locked.extend(v for k, v in params.items() if k.startswith("rollout_id") and isinstance(v, str))
        return original(stmt, conn, **kwargs)

    monkeypatch.setattr(watchdog, "lock_rows", recording)
    clock.advance(11)
    assert await store.sweep(force=True) == 1
    assert locked == [due.rollout_id]
    assert [(await store.get_attempt(r.rollout_id)).status for r in (due, within, unlimited)] == [
        AttemptStatus.TIMEOUT,
        AttemptStatus.PREPARING,
        AttemptStatus.PREPARING,
    ]


async def test_watchdog_times_out_an_attempt_after_timeout_seconds(store: Store, clock: FakeClock) -> None:
    claimed = await claimed_rollout(store, RolloutConfig(timeout_seconds=100))
    rollout_id = claimed.rollout.rollout_id
    await store.add_span(span(rollout_id))  # spans keep it alive, but not past the timeout
    clock.advance(100)
    await store.add_span(span(rollout_id))
    assert await store.sweep(force=True) == 0  # now - start == timeout: not yet
    assert (await store.get_attempt(rollout_id)).status == AttemptStatus.RUNNING
    clock.advance(0.5)
    assert await store.sweep(force=True) == 1
    attempt = await store.get_attempt(rollout_id)
    assert attempt.status == AttemptStatus.TIMEOUT
    assert attempt.end_time == clock.now
    rollout = await store.get_rollout(rollout_id)
    assert rollout.status == RolloutStatus.FAILED
    assert rollout.end_time == clock.now


async def test_watchdog_times_out_a_preparing_attempt(store: Store, clock: FakeClock) -> None:
    claimed = await claimed_rollout(store, RolloutConfig(timeout_seconds=10))
    clock.advance(11)
    assert await store.sweep(force=True) == 1
    assert (await store.get_attempt(claimed.rollout.rollout_id)).status == AttemptStatus.TIMEOUT


async def test_watchdog_marks_unresponsive_from_start_when_no_heartbeat(store: Store, clock: FakeClock) -> None:
    claimed = await claimed_rollout(store, RolloutConfig(unresponsive_seconds=30))
    rollout_id = claimed.rollout.rollout_id
    clock.advance(30)
    assert await store.sweep(force=True) == 0
    assert (await store.get_attempt(rollout_id)).status == AttemptStatus.PREPARING
    clock.advance(1)
    assert await store.sweep(force=True) == 1
    attempt = await store.get_attempt(rollout_id)
    assert attempt.status == AttemptStatus.UNRESPONSIVE
    assert (await store.get_rollout(rollout_id)).status == RolloutStatus.FAILED


async def test_watchdog_measures_unresponsive_from_the_last_heartbeat(store: Store, clock: FakeClock) -> None:
    claimed = await claimed_rollout(store, RolloutConfig(unresponsive_seconds=30))
    rollout_id = claimed.rollout.rollout_id
    clock.advance(25)
    await store.add_span(span(rollout_id))
    clock.advance(25)  # 50 s after start, 25 s after the heartbeat
    assert await store.sweep(force=True) == 0
    assert (await store.get_attempt(rollout_id)).status == AttemptStatus.RUNNING
    await store.heartbeat(rollout_id)  # an explicit heartbeat counts too
    clock.advance(30)
    assert await store.sweep(force=True) == 0
    clock.advance(1)
    assert await store.sweep(force=True) == 1
    assert (await store.get_attempt(rollout_id)).status == AttemptStatus.UNRESPONSIVE


async def test_watchdog_prefers_timeout_when_both_limits_passed(store: Store, clock: FakeClock) -> None:
    claimed = await claimed_rollout(store, RolloutConfig(timeout_seconds=10, unresponsive_seconds=5))
    clock.advance(20)
    await store.sweep(force=True)
    assert (await store.get_attempt(claimed.rollout.rollout_id)).status == AttemptStatus.TIMEOUT


async def test_watchdog_leaves_rollouts_without_limits_and_finished_ones_alone(store: Store, clock: FakeClock) -> None:
    unlimited = await claimed_rollout(store)
    done = await claimed_rollout(store, RolloutConfig(timeout_seconds=1, unresponsive_seconds=1))
    await store.update_attempt(done.rollout.rollout_id, status="succeeded")
    queued = await enqueue_one(store, config=RolloutConfig(timeout_seconds=1, unresponsive_seconds=1))
    clock.advance(10_000)
    assert await store.sweep(force=True) == 0
    assert (await store.get_attempt(unlimited.rollout.rollout_id)).status == AttemptStatus.PREPARING
    assert (await store.get_attempt(done.rollout.rollout_id)).status == AttemptStatus.SUCCEEDED
    assert (await store.get_rollout(done.rollout.rollout_id)).status == RolloutStatus.SUCCEEDED
    assert (await store.get_rollout(queued)).status == RolloutStatus.QUEUING


async def test_unforced_sweep_is_debounced(store: Store, clock: FakeClock) -> None:
    claimed = await claimed_rollout(store, RolloutConfig(timeout_seconds=1))
    assert await store.sweep() == 0  # first turn taken, nothing due yet
    clock.advance(2)
    store.watchdog_interval = 10.0
    assert await store.sweep() == 0  # another sweep ran 2 s ago: skipped
    assert (await store.get_attempt(claimed.rollout.rollout_id)).status == AttemptStatus.PREPARING
    clock.advance(10)
    assert await store.sweep() == 1
    assert (await store.get_attempt(claimed.rollout.rollout_id)).status == AttemptStatus.TIMEOUT


# -- retries ------------------------------------------------------------------------------------------------

RETRYABLE = [AttemptStatus.FAILED, AttemptStatus.TIMEOUT, AttemptStatus.UNRESPONSIVE]


def config_for(outcome: AttemptStatus, *, retry: bool, max_attempts: int) -> RolloutConfig:
    """A config under which ``outcome`` can happen, retried only if ``retry`` (the other two always are)."""
    others = [s for s in RETRYABLE if s != outcome]
    return RolloutConfig(
        timeout_seconds=10 if outcome == AttemptStatus.TIMEOUT else None,
        unresponsive_seconds=10 if outcome == AttemptStatus.UNRESPONSIVE else None,
        max_attempts=max_attempts,
        retry_condition=[*others, outcome] if retry else others,
    )


async def end_attempt(store: Store, clock: FakeClock, rollout_id: str, attempt_id: str, outcome: AttemptStatus) -> None:
    """Bring the attempt to ``outcome`` the way it happens in practice: runner report or watchdog."""
    if outcome == AttemptStatus.FAILED:
        await store.update_attempt(rollout_id, attempt_id, status=outcome)
    else:
        clock.advance(11)
        assert await store.sweep(force=True) == 1
    assert (await store.get_attempt(rollout_id, attempt_id)).status == outcome


@pytest.mark.parametrize("attempts_left", [True, False], ids=["attempts-left", "no-attempts-left"])
@pytest.mark.parametrize("retry", [True, False], ids=["in-retry-condition", "not-in-retry-condition"])
@pytest.mark.parametrize("outcome", RETRYABLE, ids=[s.value for s in RETRYABLE])
async def test_retry_happens_only_when_listed_and_attempts_remain(
    store: Store, clock: FakeClock, outcome: AttemptStatus, retry: bool, attempts_left: bool
) -> None:
    config = config_for(outcome, retry=retry, max_attempts=2 if attempts_left else 1)
    first = await claimed_rollout(store, config)
    rollout_id = first.rollout.rollout_id
    await end_attempt(store, clock, rollout_id, first.attempt.attempt_id, outcome)
    rollout = await store.get_rollout(rollout_id)
    if retry and attempts_left:
        assert rollout.status == RolloutStatus.REQUEUING
        assert rollout.end_time is None
        second = await claim_one(store, "w2")
        assert second.rollout.rollout_id == rollout_id
        assert second.attempt.sequence_id == 2
        assert second.attempt.attempt_id != first.attempt.attempt_id
        assert second.attempt.status == AttemptStatus.PREPARING
        assert second.rollout.status == RolloutStatus.PREPARING
        stored = await store.get_rollout(rollout_id, with_attempts=True)
        assert stored.status == RolloutStatus.PREPARING
        assert stored.attempt_count == 2
        assert [a.status for a in stored.attempts or []] == [outcome, AttemptStatus.PREPARING]
    else:
        assert rollout.status == RolloutStatus.FAILED
        assert rollout.end_time == clock.now
        assert await store.claim("w2") == []
        assert (await store.get_rollout(rollout_id)).attempt_count == 1


@pytest.mark.parametrize("outcome", RETRYABLE, ids=[s.value for s in RETRYABLE])
async def test_retries_stop_at_max_attempts(store: Store, clock: FakeClock, outcome: AttemptStatus) -> None:
    rollout_id = await enqueue_one(store, config=config_for(outcome, retry=True, max_attempts=3))
    for sequence in (1, 2, 3):
        claimed = await claim_one(store)
        assert claimed.attempt.sequence_id == sequence
        await end_attempt(store, clock, rollout_id, claimed.attempt.attempt_id, outcome)
        expected = RolloutStatus.REQUEUING if sequence < 3 else RolloutStatus.FAILED
        assert (await store.get_rollout(rollout_id)).status == expected
    assert await store.claim("w1") == []
    assert (await store.get_rollout(rollout_id)).attempt_count == 3


async def test_succeeded_on_a_retry_attempt_succeeds_the_rollout(store: Store, clock: FakeClock) -> None:
    rollout_id = await enqueue_one(store, config=RolloutConfig(max_attempts=2, retry_condition=["failed"]))
    first = await claim_one(store)
    await store.update_attempt(rollout_id, first.attempt.attempt_id, status="failed")
    second = await claim_one(store)
    await store.add_span(span(rollout_id, second.attempt.attempt_id))
    assert (await store.get_rollout(rollout_id)).status == RolloutStatus.RUNNING
    clock.advance(4)
    await store.update_attempt(rollout_id, second.attempt.attempt_id, status="succeeded")
    rollout = await store.get_rollout(rollout_id)
    assert rollout.status == RolloutStatus.SUCCEEDED
    assert rollout.end_time == clock.now


# -- only the latest attempt drives the rollout; stale writes are refused ------------------------------------


async def retried_rollout(store: Store) -> tuple[str, str, str]:
    """A rollout whose attempt 1 failed and was retried: (rollout id, stale attempt id, latest attempt id)."""
    rollout_id = await enqueue_one(store, config=RolloutConfig(max_attempts=3, retry_condition=["failed"]))
    first = await claim_one(store)
    await store.add_span(span(rollout_id, first.attempt.attempt_id))
    await store.update_attempt(rollout_id, first.attempt.attempt_id, status="failed")
    second = await claim_one(store)
    return rollout_id, first.attempt.attempt_id, second.attempt.attempt_id


async def snapshot(store: Store, rollout_id: str) -> tuple[Any, ...]:
    rollout = await store.get_rollout(rollout_id, with_attempts=True)
    spans = await store.query_spans(rollout_id)
    return rollout.model_dump(), [s.model_dump() for s in spans]


@pytest.mark.parametrize("status", ["succeeded", "failed", "running"])
async def test_update_attempt_on_a_stale_attempt_is_refused_and_changes_nothing(
    store: Store, clock: FakeClock, status: str
) -> None:
    rollout_id, stale, latest = await retried_rollout(store)
    before = await snapshot(store, rollout_id)
    clock.advance(1)
    with pytest.raises(ConflictError, match="stale"):
        await store.update_attempt(rollout_id, stale, status=status, metadata={"late": True})
    assert await snapshot(store, rollout_id) == before
    assert (await store.get_rollout(rollout_id)).status == RolloutStatus.PREPARING
    assert (await store.get_attempt(rollout_id, latest)).status == AttemptStatus.PREPARING


async def test_span_to_a_stale_attempt_is_refused_and_changes_nothing(store: Store, clock: FakeClock) -> None:
    rollout_id, stale, latest = await retried_rollout(store)
    before = await snapshot(store, rollout_id)
    clock.advance(1)
    with pytest.raises(ConflictError, match="stale"):
        await store.add_span(span(rollout_id, stale))
    assert await snapshot(store, rollout_id) == before
    # The refused span consumed no sequence id of either attempt.
    written = await store.add_span(span(rollout_id, latest))
    assert written is not None and written.sequence_id == 1
    assert [s.sequence_id for s in await store.query_spans(rollout_id, stale)] == [1]


async def test_heartbeat_to_a_stale_attempt_is_refused_and_changes_nothing(store: Store, clock: FakeClock) -> None:
    rollout_id, stale, _latest = await retried_rollout(store)
    before = await snapshot(store, rollout_id)
    clock.advance(1)
    with pytest.raises(ConflictError, match="stale"):
        await store.heartbeat(rollout_id, stale)
    assert await snapshot(store, rollout_id) == before


async def test_sequence_allocation_for_a_stale_attempt_is_refused(store: Store) -> None:
    rollout_id, stale, latest = await retried_rollout(store)
    with pytest.raises(ConflictError, match="stale"):
        await store.allocate_sequence(rollout_id, stale)
    assert await store.allocate_sequence(rollout_id, latest) == (latest, 1)


async def test_start_attempt_makes_the_previous_attempt_stale(store: Store) -> None:
    claimed = await claimed_rollout(store)
    rollout_id, old = claimed.rollout.rollout_id, claimed.attempt.attempt_id
    await store.start_attempt(rollout_id)
    with pytest.raises(ConflictError, match="stale"):
        await store.update_attempt(rollout_id, old, status="succeeded")
    assert (await store.get_rollout(rollout_id)).status == RolloutStatus.PREPARING
    assert (await store.get_attempt(rollout_id, old)).status == AttemptStatus.PREPARING


# -- unresponsive is revived, timeout is not -------------------------------------------------------------------


def revivable_config() -> RolloutConfig:
    return RolloutConfig(unresponsive_seconds=10, max_attempts=2, retry_condition=["unresponsive"])


async def unresponsive_rollout(store: Store, clock: FakeClock, config: RolloutConfig) -> AttemptedRollout:
    claimed = await claimed_rollout(store, config)
    await store.add_span(span(claimed.rollout.rollout_id))
    clock.advance(11)
    assert await store.sweep(force=True) == 1
    attempt = await store.get_attempt(claimed.rollout.rollout_id)
    assert attempt.status == AttemptStatus.UNRESPONSIVE
    return claimed


async def test_span_revives_an_unresponsive_attempt_to_running(store: Store, clock: FakeClock) -> None:
    claimed = await unresponsive_rollout(store, clock, revivable_config())
    rollout_id = claimed.rollout.rollout_id
    assert (await store.get_rollout(rollout_id)).status == RolloutStatus.REQUEUING
    clock.advance(1)
    await store.add_span(span(rollout_id, claimed.attempt.attempt_id))
    attempt = await store.get_attempt(rollout_id)
    assert attempt.status == AttemptStatus.RUNNING
    assert attempt.end_time is None
    assert attempt.last_heartbeat_time == clock.now
    assert (await store.get_rollout(rollout_id)).status == RolloutStatus.RUNNING
    assert await store.claim("w2") == []  # revived: it left the queue


async def test_heartbeat_revives_an_unresponsive_attempt_to_running(store: Store, clock: FakeClock) -> None:
    claimed = await unresponsive_rollout(store, clock, revivable_config())
    rollout_id = claimed.rollout.rollout_id
    attempt = await store.heartbeat(rollout_id, claimed.attempt.attempt_id)
    assert attempt.status == AttemptStatus.RUNNING
    assert (await store.get_rollout(rollout_id)).status == RolloutStatus.RUNNING
    assert await store.claim("w2") == []


async def test_revived_attempt_is_watched_again(store: Store, clock: FakeClock) -> None:
    claimed = await unresponsive_rollout(store, clock, revivable_config())
    rollout_id = claimed.rollout.rollout_id
    await store.add_span(span(rollout_id))
    clock.advance(11)
    assert await store.sweep(force=True) == 1
    assert (await store.get_attempt(rollout_id)).status == AttemptStatus.UNRESPONSIVE


async def test_span_revives_an_unresponsive_attempt_without_retries(store: Store, clock: FakeClock) -> None:
    claimed = await unresponsive_rollout(store, clock, RolloutConfig(unresponsive_seconds=10))
    rollout_id = claimed.rollout.rollout_id
    assert (await store.get_rollout(rollout_id)).status == RolloutStatus.FAILED
    await store.add_span(span(rollout_id))
    assert (await store.get_attempt(rollout_id)).status == AttemptStatus.RUNNING
    # A late outcome of the revived latest attempt is still accepted (Agent-lightning's ``* -> succeeded``).
    await store.update_attempt(rollout_id, status="succeeded")
    assert (await store.get_rollout(rollout_id)).status == RolloutStatus.SUCCEEDED


async def test_late_outcome_of_an_unresponsive_attempt_is_accepted_before_a_retry(
    store: Store, clock: FakeClock
) -> None:
    claimed = await unresponsive_rollout(store, clock, revivable_config())
    rollout_id = claimed.rollout.rollout_id
    await store.update_attempt(rollout_id, claimed.attempt.attempt_id, status="succeeded")
    rollout = await store.get_rollout(rollout_id)
    assert rollout.status == RolloutStatus.SUCCEEDED
    assert rollout.end_time == clock.now
    assert await store.claim("w2") == []


async def test_span_does_not_revive_a_timed_out_attempt(store: Store, clock: FakeClock) -> None:
    config = RolloutConfig(timeout_seconds=10, max_attempts=2, retry_condition=["timeout"])
    claimed = await claimed_rollout(store, config)
    rollout_id, attempt_id = claimed.rollout.rollout_id, claimed.attempt.attempt_id
    await store.add_span(span(rollout_id, attempt_id))
    clock.advance(11)
    assert await store.sweep(force=True) == 1
    assert (await store.get_rollout(rollout_id)).status == RolloutStatus.REQUEUING
    await store.add_span(span(rollout_id, attempt_id))
    await store.heartbeat(rollout_id, attempt_id)
    attempt = await store.get_attempt(rollout_id, attempt_id)
    assert attempt.status == AttemptStatus.TIMEOUT
    assert (await store.get_rollout(rollout_id)).status == RolloutStatus.REQUEUING
    retry = await claim_one(store, "w2")  # still in the queue
    assert retry.attempt.sequence_id == 2


@pytest.mark.parametrize("outcome", ["succeeded", "failed"])
async def test_span_does_not_revive_a_finished_attempt(store: Store, outcome: str) -> None:
    claimed = await claimed_rollout(store)
    rollout_id = claimed.rollout.rollout_id
    await store.update_attempt(rollout_id, status=outcome)
    await store.add_span(span(rollout_id))
    assert (await store.get_attempt(rollout_id)).status == AttemptStatus(outcome)
    assert (await store.get_rollout(rollout_id)).status == RolloutStatus(outcome)


# -- cancellation ---------------------------------------------------------------------------------------------


async def test_cancelled_rollout_is_never_claimed(store: Store, clock: FakeClock) -> None:
    first = await enqueue_one(store, priority=10)
    second = await enqueue_one(store)
    cancelled = await store.cancel(first)
    assert cancelled.status == RolloutStatus.CANCELLED
    assert cancelled.end_time == clock.now
    claimed = await store.claim("w1", limit=10)
    assert [c.rollout.rollout_id for c in claimed] == [second]
    assert await store.claim("w1", limit=10) == []
    assert (await store.get_rollout(first)).status == RolloutStatus.CANCELLED


async def test_cancelled_requeuing_rollout_is_never_claimed(store: Store) -> None:
    rollout_id = await enqueue_one(store, config=RolloutConfig(max_attempts=2, retry_condition=["failed"]))
    claimed = await claim_one(store)
    await store.update_attempt(rollout_id, claimed.attempt.attempt_id, status="failed")
    assert (await store.get_rollout(rollout_id)).status == RolloutStatus.REQUEUING
    await store.cancel(rollout_id)
    assert await store.claim("w1") == []


async def test_cancelling_a_running_rollout_is_final(store: Store) -> None:
    claimed = await claimed_rollout(store)
    rollout_id = claimed.rollout.rollout_id
    await store.add_span(span(rollout_id))
    await store.cancel(rollout_id)
    # The runner's late outcome is refused: the attempt stays as it was, and so does the rollout.
    for outcome in ("succeeded", "failed"):
        with pytest.raises(ConflictError, match="'cancelled'"):
            await store.update_attempt(rollout_id, status=outcome)
    assert (await store.get_attempt(rollout_id)).status == AttemptStatus.RUNNING
    assert (await store.get_rollout(rollout_id)).status == RolloutStatus.CANCELLED
    with pytest.raises(ConflictError, match="'cancelled'"):
        await store.start_attempt(rollout_id)
    # Metadata is no status: it may still be written.
    assert (await store.update_attempt(rollout_id, metadata={"note": "late"})).metadata == {"note": "late"}


async def test_a_cancelled_rollouts_preparing_attempt_is_not_revived(store: Store, clock: FakeClock) -> None:
    """Neither a heartbeat (a conflict: its runner is told to stop) nor a late span (kept: a call in flight when
    the rollout was cancelled) moves a cancelled rollout's attempt from ``preparing`` to ``running``."""
    claimed = await claimed_rollout(store)
    rollout_id, attempt_id = claimed.rollout.rollout_id, claimed.attempt.attempt_id
    await store.cancel(rollout_id)
    clock.advance(1)
    with pytest.raises(ConflictError, match="'cancelled'"):
        await store.heartbeat(rollout_id, attempt_id)
    await store.add_span(span(rollout_id, attempt_id))
    assert len(await store.query_spans(rollout_id)) == 1
    attempt = await store.get_attempt(rollout_id, attempt_id)
    assert attempt.status == AttemptStatus.PREPARING and attempt.end_time is None
    assert (await store.get_rollout(rollout_id)).status == RolloutStatus.CANCELLED


async def test_cancelling_a_succeeded_rollout_is_a_conflict(store: Store) -> None:
    claimed = await claimed_rollout(store)
    rollout_id = claimed.rollout.rollout_id
    await store.update_attempt(rollout_id, status="succeeded")
    before = await store.get_rollout(rollout_id)
    with pytest.raises(ConflictError) as info:
        await store.cancel(rollout_id)
    assert "'succeeded'" in info.value.message and "'cancelled'" in info.value.message
    assert await store.get_rollout(rollout_id) == before


async def test_cancelling_twice_is_a_no_op(store: Store, clock: FakeClock) -> None:
    rollout_id = await enqueue_one(store)
    first = await store.cancel(rollout_id)
    clock.advance(5)
    second = await store.cancel(rollout_id)
    assert second.status == RolloutStatus.CANCELLED
    assert second.end_time == first.end_time


# -- edits (Agent-lightning's update_rollout) ------------------------------------------------------------


@pytest.mark.parametrize("status", [RolloutStatus.PREPARING, RolloutStatus.RUNNING])
async def test_an_edit_cannot_make_a_rollout_preparing_or_running_without_a_live_attempt(
    store: Store, status: RolloutStatus
) -> None:
    """``preparing`` and ``running`` mirror the latest attempt: set on a queued rollout (no attempt) or a failed
    one (its attempt over), nothing would ever move the rollout on — out of the queue, no live attempt for the
    watchdog, calls refused: it (and its group's export) would wait for ever."""
    queued = await enqueue_one(store, input={"q": 1})
    with pytest.raises(ConflictError):
        await store.update_rollout(queued, {"status": status})
    assert (await store.get_rollout(queued)).status == RolloutStatus.QUEUING

    failed = await store.start_rollout({"input": "f"})
    await store.update_attempt(failed.rollout.rollout_id, status=AttemptStatus.FAILED)
    with pytest.raises(ConflictError):
        await store.update_rollout(failed.rollout.rollout_id, {"status": status})
    assert (await store.get_rollout(failed.rollout.rollout_id)).status == RolloutStatus.FAILED

    [claimed] = await store.claim("w1")  # the queued one, now with a live attempt: the edit is allowed
    assert claimed.rollout.rollout_id == queued
    if status == RolloutStatus.RUNNING:
        assert (await store.update_rollout(queued, {"status": status})).status == RolloutStatus.RUNNING
