"""Reads for training-data exports: finished rollouts in the order they finished, with the spans of each
rollout's latest attempt, in three queries per page (rollouts, the attempts whose agent server asked to drop their
sample, then their spans; a fourth for the groups' positions when rollouts are taken one by one) — never one per
rollout.

Order and cursor. Every rollout has a ``finish_seq`` (``store.sql.lifecycle.next_finish_seq``) once it finished.
An export walks *units* in the order of their ``export_seq``:

- by default a unit is a whole group, exported only once it is complete — every rollout of the group
  finished and at least ``group_size`` of them exist — at the position where its last rollout finished
  (the largest ``finish_seq`` of the group); a rollout without a group is a unit of its own at its
  ``finish_seq``;
- with ``partial=True``, or when rollouts are named by id, each finished rollout is a unit at its own
  ``finish_seq`` (groups may be incomplete).

Every rollout also carries its group's position, ``group_seq`` (what a SLIME ``group_index`` is): the largest
``finish_seq`` of the group's finished members, so the same for all members of a group read together — in
grouped mode the unit's ``export_seq``; one by one, as of the read (a member that finishes later moves it).

The cursor is the ``export_seq`` of the last unit returned (opaque, ``store.db.dialect``'s encoding): the next
page starts after it, so incremental pulls see every unit once, including a group whose early members
finished before the previous pull. A page never splits a group: ``limit`` counts rollouts, and a page ends
before a group that would not fit, except that a first group larger than ``limit`` is returned whole.
``next_cursor`` is the position after the last rollout returned; an empty page hands back ``since``, so a
poller keeps its place. Use one mode (grouped or ``partial``) per cursor. A rollout that finishes again (a
failed rollout whose late attempt succeeds) gets a new ``finish_seq`` and is exported again; so does a finished
rollout that gets a primary reward (``store.exports.reward_value``) afterwards (``store.sql.spans``, in the
reward's transaction), and with it its group.

The objects a page is made of (``ExportPage``, ``ExportRollout``, ``ExportSpan``, token arrays as ``RawJson``)
are public, in ``store.exports``.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, Connection, Select, Text, cast, func, select, union_all

from rollway.store.db import models
from rollway.store.db.dialect import decode_cursor, encode_cursor
from rollway.store.exports import (
    NOW,
    STATUSES,
    ExportPage,
    ExportQuery,
    ExportRollout,
    ExportSpan,
    ExportStatus,
    read_attributes,
)
from rollway.store.sql import matching
from rollway.store.sql.lifecycle import FINISH_COUNTER

R = models.rollouts
S = models.spans
A = models.attempts

#: Where an attempt's metadata holds an agent server's "drop this sample" (``store.sql.agents.complete`` keeps
#: the completion under ``completion``, an Osmosis 0.3 result's flag in its ``extra_fields``).
REMOVE_SAMPLE_PATH = ("completion", "extra_fields", "remove_sample")
#: Attempt ids asked about per query (well within SQLite's bound parameters).
ATTEMPTS_PER_QUERY = 1000

_ROLLOUT_COLUMNS = (
    R.c.rollout_id,
    R.c.latest_attempt_id,
    R.c.status,
    R.c.group_id,
    R.c.group_size,
    R.c.group_index,
    R.c.finish_seq,
)


def _narrowed(stmt: Select[Any], filters: ExportQuery, dialect: str) -> Select[Any]:
    """``stmt`` with the filters on a rollout's own columns: its mode and its task metadata."""
    if filters.mode is not None:
        stmt = stmt.where(R.c.mode == filters.mode)
    return stmt.where(*matching.clauses(dialect, R.c.metadata, filters.metadata_filter))


def _one_by_one(filters: ExportQuery, since: int, upto: int | None, dialect: str) -> Select[Any]:
    seq = R.c.finish_seq
    stmt = select(*_ROLLOUT_COLUMNS, seq.label("export_seq")).where(seq > since)
    if upto is not None:
        stmt = stmt.where(seq <= upto)
    if filters.rollout_ids is not None:
        stmt = stmt.where(R.c.rollout_id.in_(list(filters.rollout_ids)))
    if filters.group_id is not None:
        stmt = stmt.where(R.c.group_id == filters.group_id)
    return _narrowed(stmt, filters, dialect)


def _by_group(filters: ExportQuery, since: int, upto: int | None, dialect: str) -> Select[Any]:
    """Ungrouped rollouts at their own position, plus complete groups at the position of their last finish."""
    if filters.group_id is not None:
        touched: Any = [filters.group_id]
    else:
        touched = select(R.c.group_id).where(R.c.group_id.is_not(None), R.c.finish_seq > since)
    done = func.max(R.c.finish_seq)
    complete = (
        select(R.c.group_id, done.label("done_seq"))
        .where(R.c.group_id.in_(touched))
        .group_by(R.c.group_id)
        .having(
            func.count(R.c.finish_seq) == func.count(),
            func.count() >= func.coalesce(func.max(R.c.group_size), 1),
            done > since,
        )
    )
    if upto is not None:
        complete = complete.having(done <= upto)
    groups = complete.subquery("complete_groups")
    grouped: Select[Any] = select(*_ROLLOUT_COLUMNS, groups.c.done_seq.label("export_seq")).join(
        groups, groups.c.group_id == R.c.group_id
    )
    grouped = _narrowed(grouped, filters, dialect)  # a group's members share their task's mode and metadata
    if filters.group_id is not None:
        return grouped
    solo: Select[Any] = select(*_ROLLOUT_COLUMNS, R.c.finish_seq.label("export_seq")).where(
        R.c.group_id.is_(None), R.c.finish_seq > since
    )
    solo = _narrowed(solo, filters, dialect)
    if upto is not None:
        solo = solo.where(R.c.finish_seq <= upto)
    units = union_all(solo, grouped).subquery("units")
    return select(units)


def _units(conn: Connection, filters: ExportQuery, since: int, upto: int | None, limit: int | None) -> list[Any]:
    dialect = conn.dialect.name
    build = _one_by_one if filters.one_by_one else _by_group
    inner = build(filters, since, upto, dialect)
    rows = inner.subquery("export")
    stmt = select(rows).order_by(rows.c.export_seq, rows.c.finish_seq)
    if limit is not None:
        stmt = stmt.limit(limit)
    return list(conn.execute(stmt).mappings())


def _page(conn: Connection, filters: ExportQuery, since: int, limit: int) -> list[Any]:
    """Up to ``limit`` rollouts, ending at a unit boundary (a first unit larger than ``limit`` comes whole)."""
    rows = _units(conn, filters, since, None, limit + 1)
    if len(rows) <= limit:
        return rows
    cut = rows[limit]["export_seq"]
    if rows[limit - 1]["export_seq"] != cut:
        return rows[:limit]
    whole = [r for r in rows[:limit] if r["export_seq"] != cut]
    return whole or _units(conn, filters, cut - 1, cut, None)


def _group_seqs(conn: Connection, rollouts: list[ExportRollout], grouped: bool) -> None:
    """Set each rollout's ``group_seq``: its unit's position in grouped mode, else (one by one) the largest
    ``finish_seq`` of its group's finished members, read in one query."""
    for rollout in rollouts:
        rollout.group_seq = rollout.export_seq
    group_ids = {r.group_id for r in rollouts if r.group_id is not None}
    if grouped or not group_ids:
        return
    stmt = select(R.c.group_id, func.max(R.c.finish_seq)).where(R.c.group_id.in_(group_ids)).group_by(R.c.group_id)
    last = {row[0]: row[1] for row in conn.execute(stmt)}
    for rollout in rollouts:
        if rollout.group_id is not None:
            rollout.group_seq = last.get(rollout.group_id) or rollout.export_seq


def _remove_sample(dialect: str) -> ColumnElement[bool]:
    """Whether an attempt's metadata holds ``remove_sample: true`` (``REMOVE_SAMPLE_PATH``)."""
    if dialect == "sqlite":
        return func.json_extract(A.c.metadata, "$." + ".".join(REMOVE_SAMPLE_PATH)) == 1  # JSON true reads as 1
    *objects, key = REMOVE_SAMPLE_PATH
    value: Any = A.c.metadata
    for name in objects:
        value = value.op("->")(name)
    return cast(value.op("->>")(key), Text) == "true"


def _removed_samples(conn: Connection, rollouts: list[ExportRollout]) -> None:
    """Set ``remove_sample`` on the rollouts whose latest attempt (as the page read it) carries the flag; the
    query hands back the flagged attempts only."""
    attempts = [r.latest_attempt_id for r in rollouts if r.latest_attempt_id is not None]
    flagged: set[str] = set()
    for start in range(0, len(attempts), ATTEMPTS_PER_QUERY):
        asked = attempts[start : start + ATTEMPTS_PER_QUERY]
        stmt = select(A.c.attempt_id).where(A.c.attempt_id.in_(asked), _remove_sample(conn.dialect.name))
        flagged.update(conn.execute(stmt).scalars())
    for rollout in rollouts:
        rollout.remove_sample = rollout.latest_attempt_id in flagged


def attach_spans(conn: Connection, rollouts: list[ExportRollout]) -> None:
    """Attach the spans of each rollout's ``latest_attempt_id`` as the page read it, in sequence order (one
    query). By that attempt, not the rollout's latest now: a rollout that got a new attempt since (requeued, or
    finished again) is rendered as the page saw it, and comes again at its new position."""
    if not rollouts:
        return
    by_id = {r.rollout_id: r for r in rollouts}
    attempts = list({r.latest_attempt_id for r in rollouts if r.latest_attempt_id is not None})
    attributes = cast(S.c.attributes, Text)  # the stored text: ``read_attributes`` decodes it
    stmt = select(
        S.c.rollout_id,
        S.c.attempt_id,
        S.c.sequence_id,
        S.c.span_id,
        S.c.name,
        S.c.start_time,
        attributes,
        S.c.status_code,
    ).where(S.c.rollout_id.in_(list(by_id)), S.c.attempt_id.in_(attempts))
    for row in conn.execute(stmt):
        rollout = by_id[row[0]]
        if rollout.latest_attempt_id == row[1]:
            status = STATUSES.get(row[7]) or ExportStatus(row[7])
            rollout.spans.append(
                ExportSpan(row[0], row[1], row[2], row[3], row[4], row[5], read_attributes(row[6]), status)
            )
    for rollout in rollouts:
        rollout.spans.sort(key=lambda s: s.sequence_id)


def export(conn: Connection, query: ExportQuery, *, with_spans: bool = True) -> ExportPage:
    """The finished rollouts ``query`` asks for, after its cursor, in export order, each with its latest
    attempt's spans (see the module docstring for the order and the cursor)."""
    since = query.since
    if since == NOW:  # no rollout yet: the cursor of what finishes (or completes its group) from here on
        counters = models.counters
        value = conn.execute(select(counters.c.value).where(counters.c.name == FINISH_COUNTER)).scalar()
        return ExportPage(rollouts=[], next_cursor=encode_cursor(int(value or 0)))
    after = decode_cursor(since) or 0
    rows = _page(conn, query, after, query.limit)
    rollouts = [
        ExportRollout(
            rollout_id=r["rollout_id"],
            latest_attempt_id=r["latest_attempt_id"],
            status=r["status"],
            group_id=r["group_id"],
            group_size=r["group_size"],
            group_index=r["group_index"],
            finish_seq=r["finish_seq"],
            export_seq=r["export_seq"],
        )
        for r in rows
    ]
    _group_seqs(conn, rollouts, grouped=not query.one_by_one)
    _removed_samples(conn, rollouts)
    if with_spans:
        attach_spans(conn, rollouts)
    next_cursor = encode_cursor(rollouts[-1].export_seq) if rollouts else (since or None)
    return ExportPage(rollouts=rollouts, next_cursor=next_cursor)
