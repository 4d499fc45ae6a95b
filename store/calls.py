"""The gateway's view of a rollout when an LLM call arrives: is the attempt live, what is its sequence id,
and by when must the call end (the rollout's deadline)."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection, bindparam, update

from store import models, spans
from store.errors import ConflictError
from store.lifecycle import load_attempt, load_rollout, record_heartbeat, require_latest
from store.schemas import RolloutConfig, Span
from store.states import ATTEMPT_TERMINAL, FINISHED, AttemptStatus, RolloutStatus

A = models.attempts
_TOUCH_RUNNING = (
    update(A)
    .where(A.c.attempt_id == bindparam("aid"), A.c.status == AttemptStatus.RUNNING.value)
    .values(last_heartbeat_time=bindparam("now"))
)


@dataclass(frozen=True)
class CallTicket:
    """A call's place in its rollout: ids, its sequence id (allocated on arrival) and its deadline."""

    rollout_id: str | None
    attempt_id: str | None
    sequence_id: int
    deadline: float | None = None


def begin(conn: Connection, rollout_id: str | None, attempt_id: str | None) -> CallTicket:
    """Check the attempt can take calls and allocate the call's sequence id.

    Refused (``ConflictError``): a finished rollout, an attempt a newer one replaced, an attempt that already
    ended (succeeded, failed, timed out). An ``unresponsive`` attempt may still call: its span revives it.
    """
    if not rollout_id:
        _, first = spans.allocate(conn, None, None)
        return CallTicket(None, None, first)
    rollout = load_rollout(conn, rollout_id)
    attempt = load_attempt(conn, rollout, attempt_id or "latest")
    require_latest(rollout, attempt)
    if rollout["status"] in FINISHED:
        raise ConflictError(f"rollout '{rollout_id}' is {RolloutStatus(rollout['status'])}: it takes no more calls")
    if attempt["status"] in ATTEMPT_TERMINAL:
        raise ConflictError(
            f"attempt '{attempt['attempt_id']}' of rollout '{rollout_id}' is {AttemptStatus(attempt['status'])}: "
            "it takes no more calls"
        )
    first = spans.advance(conn, rollout_id, attempt["attempt_id"], 1)
    config = RolloutConfig.model_validate(rollout["config"])
    deadline = None if config.timeout_seconds is None else attempt["start_time"] + config.timeout_seconds
    return CallTicket(rollout_id, attempt["attempt_id"], first, deadline)


def record(conn: Connection, span: Span, now: float) -> None:
    """Write the span of a call ``begin`` admitted (its sequence id is already allocated) and count it as a
    heartbeat. The call was admitted while its attempt was live, so its span is kept even if a newer attempt
    replaced that one meanwhile (it happened on the old attempt); only the latest attempt is revived."""
    assert span.sequence_id is not None
    spans.write_spans(conn, [(span, span.rollout_id or "", span.attempt_id or "", span.sequence_id)], now)
    if not span.rollout_id or not span.attempt_id:
        return
    if conn.execute(_TOUCH_RUNNING, {"aid": span.attempt_id, "now": now}).rowcount == 1:
        return  # the common case: a running attempt, one statement
    rollout = load_rollout(conn, span.rollout_id)
    attempt = load_attempt(conn, rollout, span.attempt_id)
    if rollout["latest_attempt_id"] == attempt["attempt_id"]:
        record_heartbeat(conn, rollout, attempt, now)
