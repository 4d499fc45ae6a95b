"""The gateway processes serving on the store (``/admin/v1/replicas``): every ``rollway serve`` process, each
worker of ``rollway serve --workers N`` included, with its calls in flight as it last reported them."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, Field

from rollway.admin.context import Context
from rollway.admin.route import AdminRoute

router = APIRouter(tags=["replicas"], route_class=AdminRoute)


class ReplicaView(BaseModel):
    replica_id: str = Field(description="new at every start of the process")
    host: str
    pid: int
    started_time: float
    reported_time: float = Field(description="when the process last reported (every few seconds while it lives)")
    calls_in_flight: int = Field(description="its LLM calls in flight when it reported, all aliases")
    in_flight_by_alias: dict[str, int]


class ReplicaPage(BaseModel):
    items: list[ReplicaView]


@router.get("/replicas", response_model=ReplicaPage)
async def list_replicas(context: Context) -> ReplicaPage:
    """The live gateway processes, oldest first; a process not heard from for 15 s is taken for gone."""
    reports = await context.store.live_replicas()
    items = []
    for report in sorted(reports, key=lambda r: (r.info.started_time, r.info.replica_id)):
        by_alias = {alias: sum(counts.values()) for alias, counts in report.in_flight.items()}
        items.append(
            ReplicaView(
                replica_id=report.info.replica_id,
                host=report.info.host,
                pid=report.info.pid,
                started_time=report.info.started_time,
                reported_time=report.reported_time,
                calls_in_flight=sum(by_alias.values()),
                in_flight_by_alias={alias: n for alias, n in by_alias.items() if n},
            )
        )
    return ReplicaPage(items=items)
