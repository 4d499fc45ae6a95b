"""Pure unit tests of ``store.states``: the transition tables against Agent-lightning's "Understanding Store", the
``check_*_transition`` guards over every pair of statuses, and the propagation table.

The expected tables below are written out by hand from that document (not copied from the module), so a change to
``store/states.py`` that departs from it makes these tests fail.
"""

from __future__ import annotations

import itertools

import pytest

from rollway.store.errors import ConflictError
from rollway.store.states import (
    ATTEMPT_TRANSITIONS,
    ROLLOUT_TRANSITIONS,
    AttemptStatus,
    RolloutStatus,
    check_attempt_change,
    check_attempt_transition,
    check_rollout_transition,
    rollout_status_for_attempt,
)

A = AttemptStatus
R = RolloutStatus

#: Agent-lightning's attempt diagram: preparing/running end in succeeded/failed (runner) or timeout/unresponsive
#: (watchdog); a span takes preparing and unresponsive to running. An unresponsive attempt may still report
#: its outcome (Agent-lightning's ``* -> succeeded``) or be timed out.
EXPECTED_ATTEMPT_EDGES: set[tuple[AttemptStatus, AttemptStatus]] = {
    (A.PREPARING, A.RUNNING),
    (A.PREPARING, A.SUCCEEDED),
    (A.PREPARING, A.FAILED),
    (A.PREPARING, A.TIMEOUT),
    (A.PREPARING, A.UNRESPONSIVE),
    (A.RUNNING, A.SUCCEEDED),
    (A.RUNNING, A.FAILED),
    (A.RUNNING, A.TIMEOUT),
    (A.RUNNING, A.UNRESPONSIVE),
    (A.UNRESPONSIVE, A.RUNNING),
    (A.UNRESPONSIVE, A.SUCCEEDED),
    (A.UNRESPONSIVE, A.FAILED),
    (A.UNRESPONSIVE, A.TIMEOUT),
}

#: Agent-lightning's rollout map: queue -> preparing (new attempt) -> running -> outcome; requeuing goes back to the
#: queue; cancellation from any unfinished status; succeeded and cancelled are terminal. A failed rollout
#: can still take a late outcome of its (unresponsive) latest attempt or a manual new attempt.
EXPECTED_ROLLOUT_EDGES: set[tuple[RolloutStatus, RolloutStatus]] = {
    (R.QUEUING, R.PREPARING),
    (R.QUEUING, R.CANCELLED),
    (R.REQUEUING, R.PREPARING),
    (R.REQUEUING, R.RUNNING),
    (R.REQUEUING, R.SUCCEEDED),
    (R.REQUEUING, R.FAILED),
    (R.REQUEUING, R.CANCELLED),
    (R.PREPARING, R.RUNNING),
    (R.PREPARING, R.SUCCEEDED),
    (R.PREPARING, R.FAILED),
    (R.PREPARING, R.REQUEUING),
    (R.PREPARING, R.CANCELLED),
    (R.RUNNING, R.PREPARING),
    (R.RUNNING, R.SUCCEEDED),
    (R.RUNNING, R.FAILED),
    (R.RUNNING, R.REQUEUING),
    (R.RUNNING, R.CANCELLED),
    (R.FAILED, R.PREPARING),
    (R.FAILED, R.SUCCEEDED),
    (R.FAILED, R.REQUEUING),
}

ATTEMPT_PAIRS = list(itertools.product(AttemptStatus, AttemptStatus))
ROLLOUT_PAIRS = list(itertools.product(RolloutStatus, RolloutStatus))


def _id(pair: tuple[object, object]) -> str:
    return f"{pair[0]}->{pair[1]}"


def test_status_values_are_exactly_the_documented_lists() -> None:
    assert [s.value for s in RolloutStatus] == [
        "queuing",
        "preparing",
        "running",
        "succeeded",
        "failed",
        "requeuing",
        "cancelled",
    ]
    assert {s.value for s in AttemptStatus} == {
        "preparing",
        "running",
        "succeeded",
        "failed",
        "timeout",
        "unresponsive",
    }


def test_attempt_table_matches_agent_lightnings_state_machine() -> None:
    actual = {(src, dst) for src, dsts in ATTEMPT_TRANSITIONS.items() for dst in dsts}
    assert actual == EXPECTED_ATTEMPT_EDGES
    assert set(ATTEMPT_TRANSITIONS) == set(AttemptStatus)


def test_rollout_table_matches_agent_lightnings_state_machine() -> None:
    actual = {(src, dst) for src, dsts in ROLLOUT_TRANSITIONS.items() for dst in dsts}
    assert actual == EXPECTED_ROLLOUT_EDGES
    assert set(ROLLOUT_TRANSITIONS) == set(RolloutStatus)


@pytest.mark.parametrize("terminal", [A.SUCCEEDED, A.FAILED, A.TIMEOUT])
def test_terminal_attempt_statuses_lead_nowhere(terminal: AttemptStatus) -> None:
    assert ATTEMPT_TRANSITIONS[terminal] == frozenset()


@pytest.mark.parametrize("terminal", [R.SUCCEEDED, R.CANCELLED])
def test_terminal_rollout_statuses_lead_nowhere(terminal: RolloutStatus) -> None:
    assert ROLLOUT_TRANSITIONS[terminal] == frozenset()


@pytest.mark.parametrize("pair", ATTEMPT_PAIRS, ids=_id)
def test_check_attempt_transition_allows_exactly_agent_lightnings_edges(
    pair: tuple[AttemptStatus, AttemptStatus],
) -> None:
    current, new = pair
    if current == new or pair in EXPECTED_ATTEMPT_EDGES:
        check_attempt_transition(current, new)
        return
    with pytest.raises(ConflictError) as info:
        check_attempt_transition(current, new)
    assert f"'{current.value}'" in info.value.message
    assert f"'{new.value}'" in info.value.message


@pytest.mark.parametrize("pair", ROLLOUT_PAIRS, ids=_id)
def test_check_rollout_transition_allows_exactly_agent_lightnings_edges(
    pair: tuple[RolloutStatus, RolloutStatus],
) -> None:
    current, new = pair
    if current == new or pair in EXPECTED_ROLLOUT_EDGES:
        check_rollout_transition(current, new)
        return
    with pytest.raises(ConflictError) as info:
        check_rollout_transition(current, new)
    assert f"'{current.value}'" in info.value.message
    assert f"'{new.value}'" in info.value.message


@pytest.mark.parametrize("pair", ATTEMPT_PAIRS, ids=_id)
@pytest.mark.parametrize("rollout", list(RolloutStatus))
def test_a_cancelled_rollouts_attempt_changes_no_more_and_others_follow_the_table(
    rollout: RolloutStatus, pair: tuple[AttemptStatus, AttemptStatus]
) -> None:
    """A runner's late heartbeat or outcome must not move the attempt of a rollout the user cancelled: every
    change is a conflict that names the rollout's status; for any other rollout status the attempt table alone
    decides."""
    current, new = pair
    allowed = current == new or (pair in EXPECTED_ATTEMPT_EDGES and rollout != R.CANCELLED)
    if allowed:
        check_attempt_change(rollout, current, new)
        return
    with pytest.raises(ConflictError) as info:
        check_attempt_change(rollout, current, new)
    assert f"'{current.value}'" in info.value.message and f"'{new.value}'" in info.value.message
    assert ("'cancelled'" in info.value.message) == (rollout == R.CANCELLED)


def test_conflict_message_names_the_current_then_the_new_status() -> None:
    check_attempt_transition(AttemptStatus("preparing"), AttemptStatus("running"))
    with pytest.raises(ConflictError, match=r"'succeeded'.*'running'"):
        check_attempt_transition(AttemptStatus("succeeded"), AttemptStatus("running"))


@pytest.mark.parametrize("live", [A.PREPARING, A.RUNNING, A.SUCCEEDED])
def test_live_and_succeeded_attempts_map_to_the_same_rollout_status(live: AttemptStatus) -> None:
    everything = [A.FAILED, A.TIMEOUT, A.UNRESPONSIVE]
    assert rollout_status_for_attempt(live, 1, 5, everything) == RolloutStatus(live.value)


PROPAGATION_CASES = [
    (status, in_condition, sequence, max_attempts)
    for status in (A.FAILED, A.TIMEOUT, A.UNRESPONSIVE)
    for in_condition in (True, False)
    for sequence, max_attempts in ((1, 1), (1, 2), (2, 2), (2, 3), (3, 3))
]


@pytest.mark.parametrize(("status", "in_condition", "sequence", "max_attempts"), PROPAGATION_CASES)
def test_propagation_retries_only_when_listed_and_attempts_remain(
    status: AttemptStatus, in_condition: bool, sequence: int, max_attempts: int
) -> None:
    others = [s for s in (A.FAILED, A.TIMEOUT, A.UNRESPONSIVE) if s != status]
    condition = [*others, status] if in_condition else others
    expected = R.REQUEUING if in_condition and sequence < max_attempts else R.FAILED
    assert rollout_status_for_attempt(status, sequence, max_attempts, condition) == expected


def test_propagation_with_empty_retry_condition_always_fails() -> None:
    for status in (A.FAILED, A.TIMEOUT, A.UNRESPONSIVE):
        assert rollout_status_for_attempt(status, 1, 10, []) == R.FAILED
