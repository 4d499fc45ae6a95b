"""Spans: their writes, numbered by ``store.sql.sequences``.

Each span gets the next sequence id of its (rollout, attempt), or keeps one it was given earlier (the gateway
takes one when a call *arrives* and writes the span when it ends); the counter then only moves forward.
Every span is a heartbeat for its attempt. Writes to a stale attempt are refused. A primary reward written to
a finished rollout gives it a new finish position (``store.sql.exports``): it is exported again, with the reward.
"""

from __future__ import annotations

import secrets
from collections import defaultdict
from typing import Any, Literal

from sqlalchemy import Connection, bindparam, select, update

from rollway.store.db import models
from rollway.store.db.dialect import prebuilt, sqlite_driver, upsert
from rollway.store.db.engine import dumps
from rollway.store.errors import ConflictError, StoreValidationError
from rollway.store.exports import reward_value
from rollway.store.schemas import Span
from rollway.store.sql import convert
from rollway.store.sql.lifecycle import load_attempt, load_rollout, next_finish_seq, record_heartbeat
from rollway.store.sql.sequences import UNATTRIBUTED, advance, target

S = models.spans
R = models.rollouts
_SEQUENCE_KEY = ["rollout_id", "attempt_id", "sequence_id"]  # the columns of ``uq_spans_sequence``
# A taken sequence id skips its row (``write_spans`` then names it in a ``ConflictError``).
_SQLITE_INSERT = (
    f"INSERT INTO spans ({', '.join(convert.SPAN_COLUMNS)}) VALUES ({', '.join('?' for _ in convert.SPAN_COLUMNS)}) "
    f"ON CONFLICT ({', '.join(_SEQUENCE_KEY)}) DO NOTHING"
)


def point_span(rollout_id: str, attempt_id: str | None, name: str, attributes: dict[str, Any], now: float) -> Span:
    """A span of no duration made by the store itself (a reward reported, an event posted), at ``now``."""
    return Span(
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        trace_id=secrets.token_hex(16),
        span_id=secrets.token_hex(8),
        name=name,
        start_time=now,
        end_time=now,
        attributes=attributes,
    )


def json_text(value: Any) -> str | None:
    if value is None:
        return None
    if not value:
        if value == []:
            return "[]"
        if value == {}:
            return "{}"
    return dumps(value)


def _as_is(value: Any) -> Any:
    return value


def _build_insert(conn: Connection) -> Any:
    return upsert(conn, S).on_conflict_do_nothing(index_elements=_SEQUENCE_KEY).returning(S.c.pk)


def write_spans(conn: Connection, rows: list[tuple[Span, str, str, int]], now: float) -> None:
    """Insert spans given as (span, rollout_id, attempt_id, sequence_id). On SQLite straight through the
    driver with the JSON encoded here: SQLAlchemy's per-row parameter processing costs more than SQLite's own
    insert. A sequence id already taken (stored, or twice in ``rows``) is a ``ConflictError`` naming it; the
    caller's transaction is then rolled back, so nothing of the write is kept."""
    raw = sqlite_driver(conn)
    if raw is not None:
        inserted = raw.executemany(_SQLITE_INSERT, [convert.span_values(*row, now, json_text) for row in rows])
        if inserted.rowcount != len(rows):
            raise taken(conn, rows)
        return
    columns = convert.SPAN_COLUMNS
    values = [dict(zip(columns, convert.span_values(*row, now, _as_is), strict=True)) for row in rows]
    if len(conn.execute(prebuilt(conn, "span_insert", _build_insert), values).all()) != len(rows):
        raise taken(conn, rows)


def taken(conn: Connection, rows: list[tuple[Span, str, str, int]]) -> ConflictError:
    """The error for a write whose rows were skipped for a taken sequence id: names the first such id (held by
    a span other than the row's own; the rows written before it hold theirs)."""
    wanted: dict[tuple[str, str], list[int]] = defaultdict(list)
    for _, rollout_id, attempt_id, seq in rows:
        wanted[(rollout_id, attempt_id)].append(seq)
    holders: dict[tuple[str, str, int], str] = {}
    for (rollout_id, attempt_id), seqs in wanted.items():
        where = (S.c.rollout_id == rollout_id, S.c.attempt_id == attempt_id, S.c.sequence_id.in_(seqs))
        for row in conn.execute(select(S.c.sequence_id, S.c.span_id).where(*where)):
            holders[(rollout_id, attempt_id, row.sequence_id)] = row.span_id
    for span, rollout_id, attempt_id, seq in rows:
        holder = holders.get((rollout_id, attempt_id, seq))
        if holder is not None and holder != span.span_id:
            owner = f"attempt {attempt_id}" if attempt_id else "the unattributed spans"
            return ConflictError(f"sequence_id {seq} of {owner} is already taken (by span '{holder}')")
    return ConflictError("a sequence_id of the spans is already taken")


A = models.attempts


def add(conn: Connection, spans: list[Span], now: float, *, shared: bool = False) -> list[Span]:
    """Write spans (duplicates by ``span_id`` are skipped and not returned); assign missing sequence ids.

    The spans are updated in place with their ids: callers pass objects they own (``Store.add_spans`` does).
    A batch of several rollouts locks them in the order of their ids, whatever the request's order: two batches
    naming the same rollouts in other orders (OTLP exports, say) would otherwise lock them crosswise — on
    PostgreSQL a deadlock, broken after a second and retried. Sequence ids follow the request's order within each
    attempt (``_by_attempt``); the spans written come back in the request's order. With ``shared``, a sequence id
    another span holds is not a conflict (``_share``)."""
    rollouts: dict[str, list[Span]] = defaultdict(list)
    for span in spans:
        rollouts[span.rollout_id or UNATTRIBUTED].append(span)
    if len(rollouts) == 1:
        [(rollout_id, members)] = rollouts.items()
        if len({span.attempt_id for span in members}) == 1:
            return _add_group(conn, rollout_id, members[0].attempt_id, members, now, shared)
    written: set[int] = set()
    for rollout_id in sorted(rollouts):
        groups = _by_attempt(conn, rollout_id, rollouts[rollout_id])
        for attempt_id in sorted(groups, key=lambda given: given or ""):
            group = groups[attempt_id]
            written.update(map(id, _add_group(conn, rollout_id, attempt_id, group, now, shared)))
    out = []
    for span in spans:  # in the request's order, each span once
        if id(span) in written:
            written.discard(id(span))
            out.append(span)
    return out


def _by_attempt(conn: Connection, rollout_id: str, members: list[Span]) -> dict[str | None, list[Span]]:
    """A rollout's spans of one batch by the attempt they go to, each in the request's order. Spans that name no
    attempt go to the latest: when others name it by id, they are one group (one run of sequence ids in the
    request's order, not the unnamed ones first). The rollout is locked to read its latest attempt, in the
    batch's rollout order."""
    named = {span.attempt_id for span in members}
    latest = None
    if rollout_id and None in named and len(named) > 1:
        latest = load_rollout(conn, rollout_id)["latest_attempt_id"]
    groups: dict[str | None, list[Span]] = defaultdict(list)
    for span in members:
        groups[span.attempt_id or latest].append(span)
    return groups


# Span ids of a batch already stored for the attempt (an expanding parameter: no per-value coercion).
_KNOWN = select(S.c.span_id).where(
    S.c.rollout_id == bindparam("rid"),
    S.c.attempt_id == bindparam("aid"),
    S.c.span_id.in_(bindparam("ids", expanding=True)),
)
_KNOWN_SQLITE = (
    "SELECT span_id FROM spans WHERE rollout_id = ? AND attempt_id = ? AND span_id IN (SELECT value FROM json_each(?))"
)


# SQLite, the common case in one statement: the attempt is its rollout's latest and is running (a span is then
# only a heartbeat). Anything else takes the general path, which also raises the not-found/stale errors.
_RUNNING_TARGET_SQLITE = (
    "SELECT a.attempt_id, a.pk FROM rollouts r JOIN attempts a ON a.rollout_id = r.rollout_id "
    "AND a.attempt_id = COALESCE(?, r.latest_attempt_id) "
    "WHERE r.rollout_id = ? AND a.attempt_id = r.latest_attempt_id AND a.status = 'running'"
)
_HEARTBEAT_SQLITE = "UPDATE attempts SET last_heartbeat_time = ? WHERE pk = ?"


def _add_group(
    conn: Connection, rollout_id: str, attempt_id: str | None, group: list[Span], now: float, shared: bool = False
) -> list[Span]:
    raw = sqlite_driver(conn)
    running = None
    if raw is not None and rollout_id:
        running = raw.execute(_RUNNING_TARGET_SQLITE, (attempt_id, rollout_id)).fetchone()
    found = None
    if running is not None:
        aid = running[0]
    else:
        found = target(conn, rollout_id, attempt_id)
        aid = UNATTRIBUTED if found is None else found[1]["attempt_id"]
    ids = list({s.span_id for s in group})
    if raw is not None:  # one JSON parameter instead of one bound parameter per id
        known: Any = raw.execute(_KNOWN_SQLITE, (rollout_id, aid, dumps(ids)))
    else:
        known = conn.execute(_KNOWN, {"rid": rollout_id, "aid": aid, "ids": ids})
    skip = {r[0] for r in known}
    fresh: list[Span] = []
    for span in group:
        if span.span_id not in skip:
            skip.add(span.span_id)
            fresh.append(span)
    if not fresh:
        return []
    if shared:
        _share(conn, rollout_id, aid, fresh)
    missing = sum(1 for s in fresh if s.sequence_id is None)
    given = max((s.sequence_id for s in fresh if s.sequence_id is not None), default=0)
    next_id = advance(conn, rollout_id, aid, missing, floor=given) - missing + 1
    rows: list[tuple[Span, str, str, int]] = []
    for span in fresh:
        seq = span.sequence_id
        if seq is None:
            seq = next_id
            next_id += 1
        rows.append((span, rollout_id, aid, seq))
    write_spans(conn, rows, now)  # a sequence id already taken fails the write: a conflict
    for span, _, _, seq in rows:
        # Plain attribute writes: the values are already valid, and pydantic's __setattr__ costs more.
        span.__dict__.update(rollout_id=rollout_id or None, attempt_id=aid or None, sequence_id=seq)
    if running is not None:
        assert raw is not None  # ``running`` is only looked up on SQLite
        raw.execute(_HEARTBEAT_SQLITE, (now, running[1]))
    elif found is not None:
        record_heartbeat(conn, found[0], found[1], now)
    if rollout_id and any(reward_value(s.name, s.attributes) is not None for s in fresh):
        _finish_again(conn, rollout_id)
    return fresh


SENT_SEQUENCE = "agl_sequence_id"


def _share(conn: Connection, rollout_id: str, attempt_id: str, fresh: list[Span]) -> None:
    """Agent-lightning lets several spans share a sequence id (its LLM proxy records every span of a call under
    the one id it allocated when the call arrived); here a sequence id is one span's. A span giving an id that
    another span holds (stored, or earlier in ``fresh``) gets the next free one, and keeps the id it was sent
    with as ``agl_sequence_id``, which Agent-lightning's routes show (``agl.shapes.span``)."""
    given = list({s.sequence_id for s in fresh if s.sequence_id is not None})
    if not given:
        return
    where = (S.c.rollout_id == rollout_id, S.c.attempt_id == attempt_id, S.c.sequence_id.in_(given))
    taken = set(conn.execute(select(S.c.sequence_id).where(*where)).scalars())
    for span in fresh:
        seq = span.sequence_id
        if seq is None:
            continue
        if seq in taken:
            span.__dict__["sequence_id"] = None
            setattr(span, SENT_SEQUENCE, seq)
        else:
            taken.add(seq)


def _finish_again(conn: Connection, rollout_id: str) -> None:
    """A primary reward reached a finished rollout: give it a new finish position, so the exports' ``since``
    cursor (``store.sql.exports``) hands it, and its group, out again with the reward."""
    finished = conn.execute(select(R.c.pk, R.c.finish_seq).where(R.c.rollout_id == rollout_id)).first()
    if finished is not None and finished[1] is not None:
        conn.execute(update(R).where(R.c.pk == finished[0]).values(finish_seq=next_finish_seq(conn)))


def query(
    conn: Connection,
    rollout_id: str | None,
    attempt_id: str | Literal["latest", "all"] = "all",
    *,
    name: str | None = None,
    after_sequence: int | None = None,
    limit: int | None = None,
) -> list[Span]:
    """Spans of a rollout in order (attempt, then sequence id); ``rollout_id=None`` reads unattributed ones."""
    stmt = select(S)
    if rollout_id is None:
        stmt = stmt.where(S.c.rollout_id == UNATTRIBUTED).order_by(S.c.sequence_id)
    else:
        rollout = load_rollout(conn, rollout_id, lock=False)
        stmt = stmt.where(S.c.rollout_id == rollout_id)
        if attempt_id == "all":
            stmt = stmt.join(A, A.c.attempt_id == S.c.attempt_id).order_by(A.c.sequence_id, S.c.sequence_id)
        elif attempt_id == "latest" and rollout["latest_attempt_id"] is None:
            return []  # still queued: no attempt, so no spans (as Agent-lightning answers)
        else:
            attempt = load_attempt(conn, rollout, attempt_id, lock=False)
            stmt = stmt.where(S.c.attempt_id == attempt["attempt_id"]).order_by(S.c.sequence_id)
    if name is not None:
        stmt = stmt.where(S.c.name == name)
    if after_sequence is not None:
        stmt = stmt.where(S.c.sequence_id > after_sequence)
    if limit is not None:
        if limit < 1:
            raise StoreValidationError(f"limit must be at least 1, got {limit}")
        stmt = stmt.limit(limit)
    return [convert.span(row) for row in (conn.execute(stmt)).mappings()]
