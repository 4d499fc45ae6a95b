"""The gateway replicas' rows (``store.replicas``): one per gateway process serving on the database, holding its
last report of the calls it has in flight.

A report is written in one transaction that first reads the catalog revision and only then takes the
process's counts (``snapshot``, called inside the transaction). So a report whose ``revision`` is at least
that of a swap or pause counts every call of that replica that arrived before the change: a call missing
from it either ended or began its arrival after the revision was read, and then saw the change itself.
Rows not refreshed for ``STALE_SECONDS`` are left out of the live ones, and removed after ``FORGET_SECONDS``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from sqlalchemy import Connection, delete, select

from rollway.store.db import models
from rollway.store.db.dialect import upsert
from rollway.store.replicas import FORGET_SECONDS, STALE_SECONDS, ReplicaInfo, ReplicaReport
from rollway.store.sql import catalog

G = models.gateway_replicas


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
