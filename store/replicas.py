"""Gateway replicas: every gateway process serving on the database keeps a report of the calls it has in flight,
per alias and per configuration of the alias, so a drain asked of one replica can wait for the calls of all of
them. ``ReplicaInfo`` is who a process is and ``ReplicaReport`` what it last reported (``Store.report_replica``
and ``Store.live_replicas``; written and read by ``store.sql.replicas``).

Reports are refreshed every few seconds; rows not refreshed for ``STALE_SECONDS`` belong to processes that
are gone (their calls went with them) and are left out, and removed after ``FORGET_SECONDS``.
"""

from __future__ import annotations

from dataclasses import dataclass

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
