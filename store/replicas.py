"""Gateway replicas: every gateway process serving on the database keeps one row with its last report of the
calls it has in flight, per alias and per configuration of the alias, so a drain asked of one replica can wait
for the calls of all of them.

A report is written in one transaction that first reads the catalog revision and only then takes the
process's counts (``snapshot``, called inside the transaction). So a report whose ``revision`` is at least
that of a swap or pause counts every call of that replica that arrived before the change: a call missing
from it either ended or began its arrival after the revision was read, and then saw the change itself.
Reports are refreshed every few seconds; rows not refreshed for ``STALE_SECONDS`` belong to processes that
are gone (their calls went with them) and are left out, and removed after ``FORGET_SECONDS``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from sqlalchemy import Connection, delete, select

from rollway.store.db import models
from rollway.store.db.dialect import upsert
from rollway.store.sql import catalog

G = models.gateway_replicas
#: A replica reports at least every ``rollway.app.replicas.HEARTBEAT`` seconds; a row older than this is a dead one
#: (or one that could not write for that long: its spans could not be written either).
STALE_SECONDS = 15.0
FORGET_SECONDS = 3600.0

#: alias → configuration key → calls in flight.
Counts = dict[str, dict[str, int]]


@dataclass(frozen=True)
class ReplicaInfo:
    """Who a gateway process is (``replica_id`` is new at every start)."""

    replica_id: str
    host: str
    pid: int
    started_time: float


@dataclass(frozen=True)
class ReplicaReport:
    info: ReplicaInfo
    reported_time: float
    revision: int  # the catalog revision when the counts were taken
    in_flight: Counts


def report(
    conn: Connection, info: ReplicaInfo, snapshot: Callable[[], Mapping[str, Mapping[str, int]]], now: float
) -> int:
    """Write ``info``'s counts as ``snapshot`` gives them after the catalog revision was read; the revision."""
    revision = catalog.revision(conn)
    counts = {
        alias: {k: n for k, n in by_key.items() if n} for alias, by_key in snapshot().items() if any(by_key.values())
    }
    values = {
        "host": info.host[:255],
        "pid": info.pid,
        "started_time": info.started_time,
        "reported_time": now,
        "revision": revision,
        "in_flight": counts,
    }
    stmt = upsert(conn, G).values(replica_id=info.replica_id, **values)
    conn.execute(stmt.on_conflict_do_update(index_elements=["replica_id"], set_=values))
    conn.execute(delete(G).where(G.c.reported_time < now - FORGET_SECONDS))
    return revision


def live(conn: Connection, now: float, *, exclude: str | None = None) -> list[ReplicaReport]:
    """The reports of replicas heard from within ``STALE_SECONDS`` (but ``exclude``), oldest start first."""
    query = select(G).where(G.c.reported_time >= now - STALE_SECONDS).order_by(G.c.started_time, G.c.replica_id)
    if exclude is not None:
        query = query.where(G.c.replica_id != exclude)
    return [
        ReplicaReport(
            info=ReplicaInfo(row.replica_id, row.host, row.pid, row.started_time),
            reported_time=row.reported_time,
            revision=int(row.revision),
            in_flight={
                str(a): {str(k): int(n) for k, n in by_key.items()} for a, by_key in (row.in_flight or {}).items()
            },
        )
        for row in conn.execute(query)
    ]


def leave(conn: Connection, replica_id: str) -> None:
    """A replica stopping: its row goes (its calls have ended)."""
    conn.execute(delete(G).where(G.c.replica_id == replica_id))
