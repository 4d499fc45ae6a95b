"""Rollout and attempt statuses, and the transitions between them, as data.

The tables follow Agent-lightning's "Understanding Store": an attempt starts in ``preparing``, its first
span moves it to ``running``, the runner ends it ``succeeded`` or ``failed``, the watchdog ends it
``timeout`` or marks it ``unresponsive`` (which a later span revives). A rollout is the aggregated view of its
latest attempt plus queueing and explicit cancellation.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final

from rollway.store.errors import ConflictError


class RolloutStatus(StrEnum):
    QUEUING = "queuing"
    PREPARING = "preparing"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    REQUEUING = "requeuing"
    CANCELLED = "cancelled"


class AttemptStatus(StrEnum):
    PREPARING = "preparing"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMEOUT = "timeout"
    UNRESPONSIVE = "unresponsive"


R = RolloutStatus
A = AttemptStatus

#: Statuses an attempt may move to from each status. Terminal statuses map to nothing.
ATTEMPT_TRANSITIONS: Final[dict[AttemptStatus, frozenset[AttemptStatus]]] = {
    A.PREPARING: frozenset({A.RUNNING, A.SUCCEEDED, A.FAILED, A.TIMEOUT, A.UNRESPONSIVE}),
    A.RUNNING: frozenset({A.SUCCEEDED, A.FAILED, A.TIMEOUT, A.UNRESPONSIVE}),
    A.UNRESPONSIVE: frozenset({A.RUNNING, A.SUCCEEDED, A.FAILED, A.TIMEOUT}),
    A.SUCCEEDED: frozenset(),
    A.FAILED: frozenset(),
    A.TIMEOUT: frozenset(),
}

#: Statuses a rollout may move to from each status. ``-> preparing`` is a new attempt (claim or explicit
#: ``start_attempt``). ``failed`` is otherwise left only when its latest attempt was ``unresponsive`` and the
#: runner reports a late outcome (Agent-lightning's ``* -> succeeded`` / ``* -> requeuing``).
ROLLOUT_TRANSITIONS: Final[dict[RolloutStatus, frozenset[RolloutStatus]]] = {
    R.QUEUING: frozenset({R.PREPARING, R.CANCELLED}),
    R.REQUEUING: frozenset({R.PREPARING, R.RUNNING, R.SUCCEEDED, R.FAILED, R.CANCELLED}),
    R.PREPARING: frozenset({R.RUNNING, R.SUCCEEDED, R.FAILED, R.REQUEUING, R.CANCELLED}),
    R.RUNNING: frozenset({R.PREPARING, R.SUCCEEDED, R.FAILED, R.REQUEUING, R.CANCELLED}),
    R.FAILED: frozenset({R.PREPARING, R.SUCCEEDED, R.REQUEUING}),
    R.SUCCEEDED: frozenset(),
    R.CANCELLED: frozenset(),
}

#: Rollouts waiting in the queue.
QUEUED: Final = frozenset({R.QUEUING, R.REQUEUING})
#: Rollouts that are done as far as a waiting trainer is concerned.
FINISHED: Final = frozenset({R.SUCCEEDED, R.FAILED, R.CANCELLED})
#: Rollouts the watchdog looks after (their latest attempt is live).
ACTIVE: Final = frozenset({R.PREPARING, R.RUNNING})
#: Attempt statuses a span moves to ``running``.
REVIVED_BY_SPAN: Final = frozenset({A.PREPARING, A.UNRESPONSIVE})
#: Attempt statuses that end an attempt for good (``unresponsive`` can still be revived).
ATTEMPT_TERMINAL: Final = frozenset({A.SUCCEEDED, A.FAILED, A.TIMEOUT})
#: Attempt outcomes that may trigger a retry.
RETRYABLE: Final = frozenset({A.FAILED, A.TIMEOUT, A.UNRESPONSIVE})
#: Rollouts whose attempts no longer change status: a cancelled rollout's attempt keeps the status it had when
#: the rollout was cancelled (a runner's late heartbeat or outcome is refused, and tells it to stop).
FROZEN: Final = frozenset({R.CANCELLED})


def check_attempt_transition(current: AttemptStatus, new: AttemptStatus) -> None:
    """Raise ConflictError unless an attempt may go from ``current`` to ``new`` (same status is a no-op)."""
    if new != current and new not in ATTEMPT_TRANSITIONS[current]:
        raise ConflictError(f"attempt cannot move from '{current}' to '{new}'")


def check_attempt_change(rollout: RolloutStatus, current: AttemptStatus, new: AttemptStatus) -> None:
    """Raise ConflictError unless the attempt of a rollout in status ``rollout`` may go from ``current`` to
    ``new``: the attempt's own table, and no change at all once the rollout is ``FROZEN``."""
    if new != current and rollout in FROZEN:
        raise ConflictError(f"the rollout is '{rollout}': its attempt cannot move from '{current}' to '{new}'")
    check_attempt_transition(current, new)


def check_rollout_transition(current: RolloutStatus, new: RolloutStatus) -> None:
    """Raise ConflictError unless a rollout may go from ``current`` to ``new`` (same status is a no-op)."""
    if new != current and new not in ROLLOUT_TRANSITIONS[current]:
        raise ConflictError(f"rollout cannot move from '{current}' to '{new}'")


def rollout_status_for_attempt(
    attempt_status: AttemptStatus,
    attempt_sequence: int,
    max_attempts: int,
    retry_condition: frozenset[AttemptStatus] | set[AttemptStatus] | list[AttemptStatus],
) -> RolloutStatus:
    """The status a rollout takes from its latest attempt (Agent-lightning's propagation table)."""
    if attempt_status in (A.PREPARING, A.RUNNING, A.SUCCEEDED):
        return RolloutStatus(attempt_status.value)
    if attempt_status in retry_condition and attempt_sequence < max_attempts:
        return R.REQUEUING
    return R.FAILED
