"""Remote agent servers in the store (SQLite and PostgreSQL): the registry keeps the key secret, runner claims
and agent claims never take each other's tasks, an agent claim respects the server's concurrency, and a
completion report is recorded once (reward span, metadata, status) and refused when it comes too late."""

from __future__ import annotations

import pytest

from rollway.store import (
    AgentServer,
    ConflictError,
    NotFoundError,
    RemoteCompletion,
    RolloutConfig,
    Store,
    StoreValidationError,
)
from support.clock import FakeClock


async def test_the_registry_stores_the_api_key_and_never_prints_it(store: Store) -> None:
    saved = await store.put_agent(AgentServer(name="math", url="http://127.0.0.1:9/", api_key="secret-123"))
    assert saved.url == "http://127.0.0.1:9"
    assert saved.api_key is not None and saved.api_key.get_secret_value() == "secret-123"
    assert "secret-123" not in repr(saved) and "secret-123" not in saved.model_dump_json()
    replaced = await store.put_agent(AgentServer(name="math", url="http://127.0.0.1:10", max_concurrent=3))
    assert (replaced.url, replaced.api_key, replaced.max_concurrent) == ("http://127.0.0.1:10", None, 3)
    assert [a.name for a in await store.list_agents()] == ["math"]
    await store.delete_agent("math")
    assert await store.list_agents() == []
    with pytest.raises(NotFoundError):
        await store.delete_agent("math")
    with pytest.raises(StoreValidationError):
        await store.put_agent(AgentServer(name="bad", url="ftp://x"))


async def test_a_server_keeps_the_protocol_it_is_registered_with(store: Store) -> None:
    """A registration's ``protocol`` (``v1`` or ``0.3``, else None: told by its ``/health``) is stored, and a
    replacement without one clears it."""
    saved = await store.put_agent(AgentServer(name="osm", url="http://127.0.0.1:9", protocol="0.3"))
    assert saved.protocol == "0.3" and (await store.get_agent("osm")).protocol == "0.3"
    assert [a.protocol for a in await store.list_agents()] == ["0.3"]
    await store.put_agent(AgentServer(name="osm", url="http://127.0.0.1:9"))
    assert (await store.get_agent("osm")).protocol is None
    with pytest.raises(ValueError):
        AgentServer(name="osm", url="http://127.0.0.1:9", protocol="0.2")


async def test_runner_claims_never_take_agent_tasks_and_agent_claims_only_their_own(store: Store) -> None:
    await store.put_agent(AgentServer(name="a", url="http://127.0.0.1:9"))
    await store.put_agent(AgentServer(name="b", url="http://127.0.0.1:9"))
    for_a = await store.enqueue([{"input": i, "agent": "a"} for i in range(3)])
    for_b = await store.enqueue([{"input": "b", "agent": "b"}])
    plain = await store.enqueue([{"input": "runner"}])

    claimed = await store.claim("runner-1", limit=10)
    assert [c.rollout.rollout_id for c in claimed] == [plain[0].rollout_id]
    assert await store.claim("runner-1", limit=10) == []

    got_a = await store.claim_for_agent("a", limit=10)
    assert [c.rollout.rollout_id for c in got_a] == [r.rollout_id for r in for_a]  # FIFO
    assert {c.attempt.worker_id for c in got_a} == {"agent:a"}
    got_b = await store.claim_for_agent("b", limit=10)
    assert [c.rollout.rollout_id for c in got_b] == [for_b[0].rollout_id]
    with pytest.raises(NotFoundError):
        await store.claim_for_agent("nobody")


async def test_an_agent_claim_hands_out_no_more_than_the_free_slots(store: Store) -> None:
    await store.put_agent(AgentServer(name="a", url="http://127.0.0.1:9", max_concurrent=2))
    await store.enqueue([{"input": i, "agent": "a"} for i in range(5)])
    first = await store.claim_for_agent("a", limit=10)
    assert len(first) == 2
    assert await store.claim_for_agent("a", limit=10) == []
    done = RemoteCompletion(rollout_id=first[0].rollout.rollout_id, status="COMPLETED", reward=1.0)
    await store.complete_remote(done)
    assert len(await store.claim_for_agent("a", limit=10)) == 1  # one slot freed


async def test_a_completion_is_recorded_once_with_its_reward_span(store: Store) -> None:
    await store.put_agent(AgentServer(name="a", url="http://127.0.0.1:9"))
    await store.enqueue([{"input": "x", "agent": "a", "rollout_id": "ro-1"}])
    [claimed] = await store.claim_for_agent("a")
    report = RemoteCompletion(
        rollout_id="ro-1", status="COMPLETED", reward=0.75, metrics={"num_llm_calls": 2}, finish_reason="stop"
    )
    attempt, duplicate = await store.complete_remote(report, claimed.attempt.attempt_id)
    assert not duplicate and attempt.status == "succeeded"
    assert attempt.metadata is not None and attempt.metadata["completion"]["metrics"] == {"num_llm_calls": 2}
    assert (await store.get_rollout("ro-1")).status == "succeeded"

    again, duplicate = await store.complete_remote(report.model_copy(update={"reward": 0.0, "status": "ERROR"}))
    assert duplicate and again == attempt
    spans = await store.query_spans("ro-1")
    assert [(s.name, s.attributes["rollway.reward.value"]) for s in spans] == [("rollway.reward", 0.75)]
    with pytest.raises(NotFoundError):
        await store.complete_remote(RemoteCompletion(rollout_id="ro-unknown", status="COMPLETED"))


async def test_a_completion_keeps_metrics_that_are_not_finite_as_their_names(store: Store) -> None:
    """A NaN loss or an infinite reward component is kept as the name Python's json module gives it ("NaN",
    "Infinity", "-Infinity"), wherever it sits in the report, so that it never reads back as null (no value)."""
    await store.put_agent(AgentServer(name="a", url="http://127.0.0.1:9"))
    await store.enqueue([{"input": "x", "agent": "a", "rollout_id": "ro-1"}])
    await store.claim_for_agent("a")
    nan, inf = float("nan"), float("inf")
    report = RemoteCompletion(
        rollout_id="ro-1",
        status="COMPLETED",
        metrics={"loss": nan, "reward_parts": [inf, -inf, 0.5], "empty": None, "calls": 2},
        extra_fields={"grad_norm": {"max": inf}},
        final_messages=[{"role": "assistant", "content": "x", "score": nan}],
    )
    await store.complete_remote(report)
    completion = (await store.get_attempt("ro-1")).metadata["completion"]  # type: ignore[index]
    assert completion["metrics"] == {
        "loss": "NaN",
        "reward_parts": ["Infinity", "-Infinity", 0.5],
        "empty": None,
        "calls": 2,
    }
    assert completion["extra_fields"] == {"grad_norm": {"max": "Infinity"}}
    assert completion["final_messages"] == [{"role": "assistant", "content": "x", "score": "NaN"}]


async def test_an_error_report_fails_the_attempt_and_the_rollout_retries(store: Store) -> None:
    await store.put_agent(AgentServer(name="a", url="http://127.0.0.1:9"))
    config = RolloutConfig(max_attempts=2, retry_condition=["failed"])
    await store.enqueue([{"input": "x", "agent": "a", "rollout_id": "ro-1", "config": config}])
    await store.claim_for_agent("a")
    attempt, _ = await store.complete_remote(
        RemoteCompletion(rollout_id="ro-1", status="ERROR", error_message="tool crashed")
    )
    assert attempt.status == "failed" and attempt.metadata is not None
    assert attempt.metadata["completion"]["error_message"] == "tool crashed"
    assert (await store.get_rollout("ro-1")).status == "requeuing"
    [again] = await store.claim_for_agent("a")
    assert again.attempt.sequence_id == 2


async def test_a_completion_after_the_attempt_timed_out_is_a_conflict(store: Store, clock: FakeClock) -> None:
    await store.put_agent(AgentServer(name="a", url="http://127.0.0.1:9"))
    config = RolloutConfig(timeout_seconds=5, max_attempts=2, retry_condition=["timeout"])
    await store.enqueue([{"input": "x", "agent": "a", "rollout_id": "ro-1", "config": config}])
    [first] = await store.claim_for_agent("a")
    clock.advance(6)
    await store.sweep(force=True)
    assert (await store.get_rollout("ro-1")).status == "requeuing"
    late = RemoteCompletion(rollout_id="ro-1", status="COMPLETED", reward=1.0)
    with pytest.raises(ConflictError):
        await store.complete_remote(late, first.attempt.attempt_id)
    [second] = await store.claim_for_agent("a")
    with pytest.raises(ConflictError):  # the old attempt's key cannot land on the retry
        await store.complete_remote(late, first.attempt.attempt_id)
    attempt, _ = await store.complete_remote(late, second.attempt.attempt_id)
    assert attempt.status == "succeeded"


async def test_dispatch_facts_merge_into_metadata_without_losing_a_completion(store: Store) -> None:
    await store.put_agent(AgentServer(name="a", url="http://127.0.0.1:9"))
    await store.enqueue([{"input": "x", "agent": "a", "rollout_id": "ro-1"}])
    [claimed] = await store.claim_for_agent("a")
    await store.complete_remote(RemoteCompletion(rollout_id="ro-1", status="COMPLETED"))
    assert await store.record_dispatch("ro-1", claimed.attempt.attempt_id, {"tools": [{"type": "function"}]})
    attempt = await store.get_attempt("ro-1")
    assert attempt.metadata is not None
    assert attempt.metadata["dispatch"] == {"tools": [{"type": "function"}]}
    assert attempt.metadata["completion"]["status"] == "COMPLETED"


async def test_an_admission_in_progress_is_lost_only_once_its_mark_is_old(store: Store, clock: FakeClock) -> None:
    """An attempt whose 0.3 admission is marked in progress (``dispatch.admitting``) is not an init to send again
    while the mark is fresh, however old the attempt; once the mark is old (its process gone) it is. An admitted
    attempt (the mark cleared) never is."""
    await store.put_agent(AgentServer(name="a", url="http://127.0.0.1:9"))
    await store.enqueue([{"input": "x", "agent": "a", "rollout_id": "ro-1"}])
    [claimed] = await store.claim_for_agent("a")
    attempt_id = claimed.attempt.attempt_id
    clock.advance(100)
    now = clock()
    assert [a.attempt.attempt_id for a in await store.undispatched_attempts("a", now - 10, now - 20)] == [attempt_id]
    await store.record_dispatch("ro-1", attempt_id, {"agent": "a", "protocol": "osmosis-0.3", "admitting": now - 15})
    assert await store.undispatched_attempts("a", now - 10, now - 20) == []  # marked 15 s ago: in progress
    lost = await store.undispatched_attempts("a", now - 10, now - 14)  # a mark older than 14 s is lost
    assert [a.attempt.attempt_id for a in lost] == [attempt_id]
    await store.record_dispatch("ro-1", attempt_id, {"osmosis_id": attempt_id, "admitting": None})
    assert await store.undispatched_attempts("a", now, now) == []


def test_values_the_columns_cannot_hold_are_refused_before_they_reach_the_database() -> None:
    from pydantic import ValidationError

    from rollway.store import Backend, Span, TaskSpec

    assert TaskSpec(agent="a" * 128, priority=2**31 - 1).agent == "a" * 128
    for bad in ({"agent": "a" * 129}, {"agent": ""}, {"priority": 2**31}, {"priority": 6972138355710955094016}):
        with pytest.raises(ValidationError):
            TaskSpec(**bad)
    with pytest.raises(ValidationError):
        TaskSpec(config={"max_attempts": 962729990305581016249532416})  # read back as a float: a 500
    with pytest.raises(ValidationError):
        Span(trace_id="t", span_id="s", name="n", sequence_id=2**31)
    with pytest.raises(ValidationError):
        Backend(base_url="http://x", model="m", max_concurrency=55747671734836600504320)
