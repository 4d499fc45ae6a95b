"""Spans: their writes, numbered by ``store.sql.sequences``.

Each span gets the next sequence id of its (rollout, attempt), or keeps one it was given earlier (the gateway
takes one when a call *arrives* and writes the span when it ends); the counter then only moves forward.
Every span is a heartbeat for its attempt. Writes to a stale attempt are refused. A primary reward written to
a finished rollout gives it a new finish position (``store.sql.exports``): it is exported again, with the reward.
"""

from __future__ import annotations

import secrets
from collections import defaultdict
from collections.abc import Collection
from typing import Any, Literal

from sqlalchemy import Connection, bindparam, select, update

from rollway.store import ids
from rollway.store.db import models
from rollway.store.db.dialect import prebuilt, serialize_key, sqlite_driver, upsert
from rollway.store.db.engine import dumps, loads
from rollway.store.errors import ConflictError, StoreValidationError
from rollway.store.exports import reward_value
from rollway.store.schemas import Span
from rollway.store.sql import convert
from rollway.store.sql.lifecycle import load_attempt, load_rollout, next_finish_seq, record_heartbeat
from rollway.store.sql.replays import other_request
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


def add_keyed(
    conn: Connection, spans: list[Span], now: float, key: str, stamped: Collection[str] = ()
) -> tuple[list[Span], int]:
    """``add`` for a request sent with an idempotency key: every span of it as stored, and how many of them
    were written now.

    A span whose id derives from the key (``ids.derived_hex(key, position, "span")``: the admin API gives one
    to each span the request sent without an id) can only have been written by an earlier try of this request:
    it is looked up across the rollout's attempts (a new attempt may have begun since) and returned as stored.
    Finding one makes the request a try sent again, which must be the first one's request (``_same_request``).
    A span with the client's own id keeps that id's rule (one per attempt): already on its attempt, it is
    returned as stored there. ``stamped`` names fields the caller set on this try itself (a reward's time),
    which are not the client's and are not compared."""
    serialize_key(conn, key)
    places = [_place(span) for span in spans]
    derived = {
        place
        for i, (span, place) in enumerate(zip(spans, places, strict=True))
        if span.span_id == ids.derived_hex(key, i, "span")
    }
    # Where the first try had a span with a derived id that this request has not: after its last span (the
    # first one was longer), and where this one gives a span its own id.
    after = ids.derived_hex(key, len(spans), "span")
    foreign = {(rollout_id, after) for rollout_id, _ in places}
    foreign.update((p[0], ids.derived_hex(key, i, "span")) for i, p in enumerate(places) if p not in derived)
    stored = _stored(conn, derived | foreign)
    if stored:
        _same_request(conn, key, list(zip(spans, places, strict=True)), derived, stored, stamped)
    fresh = [span for span, place in zip(spans, places, strict=True) if place not in stored]
    new = add(conn, fresh, now)
    written = {_place(s): s for s in new}
    skipped = [s for s in fresh if _place(s) not in written]
    stored.update(_on_their_attempts(conn, skipped))
    return [found for place in places if (found := written.get(place) or stored.get(place)) is not None], len(new)


def _same_request(
    conn: Connection,
    key: str,
    request: list[tuple[Span, tuple[str, str]]],
    derived: set[tuple[str, str]],
    stored: dict[tuple[str, str], Span],
    stamped: Collection[str],
) -> None:
    """Refuse a request that found spans its key's first try wrote unless it is that request again (see
    ``store.sql.replays`` for why the stored spans are what it is compared with). The first try wrote all of its
    spans in one transaction, so this one must find each of its spans with a derived id, and no derived id at a
    place where it has none; each span with the client's own id must be stored in its rollout (the first try
    wrote it, or found it there); and each span must hold what the request gives it."""
    if stored.keys() != derived:
        raise other_request(key)
    own = {place for _, place in request if place not in derived}
    if len(_stored(conn, own)) != len(own):
        raise other_request(key)
    for span, place in request:
        if place in derived and not _same_span(span, stored[place], stamped):
            raise other_request(key)


def _same_span(asked: Span, stored: Span, stamped: Collection[str]) -> bool:
    """Every field of ``asked`` as JSON stores it, but the ones the store fills in (the rollout, from the place;
    the attempt and the sequence id, unless the request gives them) and the ``stamped`` ones."""
    skip = {"rollout_id", *stamped}
    if asked.attempt_id is None:
        skip.add("attempt_id")
    if asked.sequence_id is None:
        skip.add("sequence_id")
    return bool(loads(dumps(asked.model_dump(exclude=skip))) == loads(dumps(stored.model_dump(exclude=skip))))


def _stored(conn: Connection, places: set[tuple[str, str]]) -> dict[tuple[str, str], Span]:
    """Spans stored under (rollout id, span id), on any attempt of the rollout."""
    wanted: dict[str, list[str]] = defaultdict(list)
    for rollout_id, span_id in places:
        wanted[rollout_id].append(span_id)
    found: dict[tuple[str, str], Span] = {}
    for rollout_id, span_ids in wanted.items():
        rows = conn.execute(select(S).where(S.c.rollout_id == rollout_id, S.c.span_id.in_(span_ids))).mappings()
        found.update({(rollout_id, row["span_id"]): convert.span(row) for row in rows})
    return found


def _on_their_attempts(conn: Connection, spans: list[Span]) -> dict[tuple[str, str], Span]:
    """The stored spans that ``add`` skipped for ``spans`` (same id on the attempt each went to: the one it
    names, else its rollout's latest): one query per (rollout, attempt)."""
    latest: dict[str, str] = {}
    wanted: dict[tuple[str, str], list[str]] = defaultdict(list)
    for span in spans:
        rollout_id = span.rollout_id or UNATTRIBUTED
        attempt_id = span.attempt_id
        if attempt_id is None:
            if rollout_id not in latest:
                found = conn.execute(select(R.c.latest_attempt_id).where(R.c.rollout_id == rollout_id)).scalar()
                latest[rollout_id] = found or UNATTRIBUTED
            attempt_id = latest[rollout_id]
        wanted[(rollout_id, attempt_id)].append(span.span_id)
    stored: dict[tuple[str, str], Span] = {}
    for (rollout_id, attempt_id), span_ids in wanted.items():
        where = (S.c.rollout_id == rollout_id, S.c.attempt_id == attempt_id, S.c.span_id.in_(span_ids))
        stored.update(
            {
                (rollout_id, row["span_id"]): convert.span(row)
                for row in conn.execute(select(S).where(*where)).mappings()
            }
        )
    return stored


def _place(span: Span) -> tuple[str, str]:
    """Where a span is known by id: (its rollout, or the unattributed bucket; its span id)."""
    return (span.rollout_id or UNATTRIBUTED, span.span_id)


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
