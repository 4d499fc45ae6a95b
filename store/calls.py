"""The gateway's view of a rollout when an LLM call arrives: is the attempt live, what is its sequence id,
and by when must the call end (the rollout's deadline)."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncConnection

from store import spans
from store.errors import ConflictError
from store.lifecycle import load_attempt, load_rollout, require_latest
from store.schemas import RolloutConfig
from store.states import ATTEMPT_TERMINAL, FINISHED, AttemptStatus, RolloutStatus


@dataclass(frozen=True)
class CallTicket:
    """A call's place in its rollout: ids, its sequence id (allocated on arrival) and its deadline."""

    rollout_id: str | None
    attempt_id: str | None
    sequence_id: int
    deadline: float | None = None


async def begin(conn: AsyncConnection, rollout_id: str | None, attempt_id: str | None) -> CallTicket:
    """Check the attempt can take calls and allocate the call's sequence id.

    Refused (``ConflictError``): a finished rollout, an attempt a newer one replaced, an attempt that already
    ended (succeeded, failed, timed out). An ``unresponsive`` attempt may still call: its span revives it.
    """
    if not rollout_id:
        _, first = await spans.allocate(conn, None, None)
        return CallTicket(None, None, first)
    rollout = await load_rollout(conn, rollout_id)
    attempt = await load_attempt(conn, rollout, attempt_id or "latest")
    require_latest(rollout, attempt)
    if rollout["status"] in FINISHED:
        raise ConflictError(f"rollout '{rollout_id}' is {RolloutStatus(rollout['status'])}: it takes no more calls")
    if attempt["status"] in ATTEMPT_TERMINAL:
        raise ConflictError(
            f"attempt '{attempt['attempt_id']}' of rollout '{rollout_id}' is {AttemptStatus(attempt['status'])}: "
            "it takes no more calls"
        )
    first = await spans.advance(conn, rollout_id, attempt["attempt_id"], 1)
    config = RolloutConfig.model_validate(rollout["config"])
    deadline = None if config.timeout_seconds is None else attempt["start_time"] + config.timeout_seconds
    return CallTicket(rollout_id, attempt["attempt_id"], first, deadline)
