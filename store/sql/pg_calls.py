"""An LLM call's two writes on PostgreSQL (``calls.begin`` and ``calls.record``), each as one statement on the
driver's own connection outside any transaction: one round trip where SQLAlchemy's transaction costs five or
more (BEGIN, the reads, the write, COMMIT), each a loopback send and wake-up. A single statement is its own
transaction, so what each does is as atomic as the multi-statement versions: ``begin`` locks the rollout and the
attempt rows (``FOR UPDATE``, as ``calls.begin`` does through ``lifecycle``) and allocates the sequence id only
when the checks hold; ``record`` inserts the span and, only if it was inserted, touches a running attempt.

What is rare stays in ``calls``: naming the holder of a taken sequence id, and reviving an attempt that is not
running (``record``'s caller runs those in a transaction of their own)."""

from __future__ import annotations

from typing import Any

from rollway.store.errors import NotFoundError
from rollway.store.sql import catalog, convert
from rollway.store.sql.calls import CallTicket, Target, check
from rollway.store.states import ATTEMPT_TERMINAL, FINISHED

_FINISHED = sorted(status.value for status in FINISHED)
_TERMINAL = sorted(status.value for status in ATTEMPT_TERMINAL)

_BEGIN = f"""
WITH r AS (
    SELECT rollout_id, status, latest_attempt_id, (config ->> 'timeout_seconds')::float8 AS timeout_seconds
    FROM rollouts WHERE rollout_id = $1 FOR UPDATE
), a AS (
    SELECT attempts.attempt_id, attempts.status, attempts.start_time FROM attempts, r
    WHERE attempts.rollout_id = r.rollout_id AND attempts.attempt_id = COALESCE($2, r.latest_attempt_id)
    FOR UPDATE OF attempts
), seq AS (
    INSERT INTO span_sequences (rollout_id, attempt_id, last_value)
    SELECT r.rollout_id, a.attempt_id, 1 FROM r, a
    WHERE a.attempt_id = r.latest_attempt_id AND r.status <> ALL($3::text[]) AND a.status <> ALL($4::text[])
    ON CONFLICT (rollout_id, attempt_id) DO UPDATE SET last_value = span_sequences.last_value + 1
    RETURNING last_value
)
SELECT r.status, r.latest_attempt_id, r.timeout_seconds, a.attempt_id, a.status, a.start_time,
    (SELECT value FROM counters WHERE name = '{catalog.REVISION}'), (SELECT last_value FROM seq)
FROM r LEFT JOIN a ON true
"""

_BEGIN_UNATTRIBUTED = f"""
INSERT INTO span_sequences (rollout_id, attempt_id, last_value) VALUES ('', '', 1)
ON CONFLICT (rollout_id, attempt_id) DO UPDATE SET last_value = span_sequences.last_value + 1
RETURNING last_value, (SELECT value FROM counters WHERE name = '{catalog.REVISION}')
"""

_COLUMNS = convert.SPAN_COLUMNS
_RECORD = f"""
WITH ins AS (
    INSERT INTO spans ({", ".join(_COLUMNS)}) VALUES ({", ".join(f"${i}" for i in range(1, len(_COLUMNS) + 1))})
    ON CONFLICT (rollout_id, attempt_id, sequence_id) DO NOTHING RETURNING pk
), touch AS (
    UPDATE attempts SET last_heartbeat_time = ${len(_COLUMNS) + 1}
    WHERE attempt_id = ${len(_COLUMNS) + 2} AND status = 'running' AND EXISTS (SELECT 1 FROM ins)
    RETURNING 1
)
SELECT (SELECT count(*) FROM ins), (SELECT count(*) FROM touch)
"""


async def begin(driver: Any, rollout_id: str | None, attempt_id: str | None) -> CallTicket:
    """``calls.begin`` in one statement (``driver``: an asyncpg connection)."""
    if not rollout_id:
        first, revision = await driver.fetchrow(_BEGIN_UNATTRIBUTED)
        return CallTicket(None, None, int(first), catalog_revision=int(revision or 0))
    row = await driver.fetchrow(_BEGIN, rollout_id, attempt_id, _FINISHED, _TERMINAL)
    if row is not None and row[3] is None and row[1] is not None:
        # No such attempt in the statement's snapshot, taken before it waited for the rollout's lock: a claim
        # that committed meanwhile may have made a newer attempt the latest. A new statement sees it.
        row = await driver.fetchrow(_BEGIN, rollout_id, attempt_id, _FINISHED, _TERMINAL)
    if row is None:
        raise NotFoundError(f"rollout '{rollout_id}' not found")
    target = Target(row[0], row[1], row[2], row[3], row[4], row[5], int(row[6] or 0))
    check(target, rollout_id, attempt_id)
    sequence_id = row[7]
    assert sequence_id is not None, "the checks passed, so the sequence id was allocated"
    timeout = target.timeout_seconds
    deadline = None if timeout is None or target.attempt_start is None else target.attempt_start + timeout
    return CallTicket(rollout_id, target.attempt_id, int(sequence_id), deadline, target.catalog_revision)


async def record(driver: Any, values: tuple[Any, ...], now: float, attempt_id: str) -> tuple[bool, bool]:
    """Insert a call's span (``values`` in ``convert.SPAN_COLUMNS`` order, JSON as text) and touch its attempt
    if it is running: (inserted, touched). Not inserted: its sequence id is taken."""
    inserted, touched = await driver.fetchrow(_RECORD, *values, now, attempt_id)
    return bool(inserted), bool(touched)
