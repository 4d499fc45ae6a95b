"""Counts by status, spans, tokens, uptime (``/admin/v1/stats``)."""

from __future__ import annotations

import time

from fastapi import APIRouter

from rollway.admin.context import Context
from rollway.admin.route import AdminRoute
from rollway.admin.schemas import StatsView

router = APIRouter(tags=["stats"], route_class=AdminRoute)


@router.get("/stats", response_model=StatsView)
async def stats(context: Context) -> StatsView:
    counts = await context.store.stats()
    return StatsView(
        rollouts_by_status=counts.rollouts_by_status,
        attempts_by_status=counts.attempts_by_status,
        queue_depth=counts.queue_depth,
        total_rollouts=counts.total_rollouts,
        total_attempts=counts.total_attempts,
        total_spans=counts.total_spans,
        input_tokens=counts.input_tokens,
        output_tokens=counts.output_tokens,
        uptime_seconds=time.time() - context.started,
    )
