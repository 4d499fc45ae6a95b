"""Spans sent with an idempotency key (``add_keyed``): a request tried again finds what its first try wrote, and
a different request under the same key is refused (``store.sql.replays``)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection

from sqlalchemy import Connection, select

from rollway.store import ids
from rollway.store.db import models
from rollway.store.db.dialect import serialize_key
from rollway.store.db.engine import dumps, loads
from rollway.store.schemas import Span
from rollway.store.sql import convert
from rollway.store.sql.replays import other_request
from rollway.store.sql.sequences import UNATTRIBUTED
from rollway.store.sql.spans import add

S = models.spans
R = models.rollouts


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
