"""Counts by status, spans, tokens, uptime (``/admin/v1/stats``); the cheap counts alone
(``/admin/v1/stats/status``) and the calls over a recent window (``/admin/v1/stats/series``), which the
dashboard polls."""

from __future__ import annotations

import math
import time
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query

from rollway.admin import series
from rollway.admin.context import Context
from rollway.admin.route import AdminRoute
from rollway.admin.schemas import SeriesPoint, SeriesView, StatsView, StatusCountsView
from rollway.store.states import QUEUED

router = APIRouter(tags=["stats"], route_class=AdminRoute)

#: The most buckets one series answer holds (a day by the minute).
MAX_POINTS = 1440


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


@router.get("/stats/status", response_model=StatusCountsView)
async def status_counts(context: Context) -> StatusCountsView:
    """Rollouts and attempts by status (every status, zeros included) and the queue depth; unlike `/stats` it
    reads no span, so its cost does not grow with the calls recorded."""
    rollouts, attempts = await context.store.status_counts()
    queue_depth = sum(rollouts.get(status.value, 0) for status in QUEUED)
    return StatusCountsView(rollouts_by_status=rollouts, attempts_by_status=attempts, queue_depth=queue_depth)


@router.get("/stats/series", response_model=SeriesView)
async def call_series(
    context: Context,
    window_seconds: Annotated[float, Query(ge=1, le=86_400)] = 3600,
    step_seconds: Annotated[float, Query(ge=1, le=3600)] = 60,
) -> SeriesView:
    """The gateway's calls of the last `window_seconds`, in buckets of `step_seconds` (at most 1440 buckets),
    from the call spans in the store: calls per second, errors, mean and max latency, mean time to first
    token (streamed calls), prompt and output tokens. Buckets end at the current time."""
    count = math.ceil(window_seconds / step_seconds)
    if count > MAX_POINTS:
        raise HTTPException(400, f"window_seconds / step_seconds must be at most {MAX_POINTS}, got {count}")
    since = time.time() - count * step_seconds
    found = await context.store.read(lambda conn: series.call_buckets(conn, since, step_seconds))
    rewarded = await context.store.read(lambda conn: series.reward_buckets(conn, since, step_seconds))
    buckets = {b.index: b for b in found}
    points = []
    for i in range(count):
        b = buckets.get(i)
        if b is None:
            points.append(_empty(since + i * step_seconds))
        else:
            points.append(_point(b, since + i * step_seconds, step_seconds))
        n, total = rewarded.get(i, (0, 0.0))
        points[-1].rewards, points[-1].reward_mean = n, (total / n if n else None)
    return SeriesView(since=since, step_seconds=step_seconds, points=points)


def _point(b: series.Bucket, start: float, step_seconds: float) -> SeriesPoint:
    return SeriesPoint(
        start=start,
        calls=b.calls,
        calls_per_second=b.calls / step_seconds,
        errors=b.errors,
        latency_mean_seconds=b.latency_sum / b.calls,
        latency_max_seconds=b.latency_max,
        ttft_mean_seconds=b.ttft_sum / b.ttft_count if b.ttft_count else None,
        input_tokens=b.input_tokens,
        output_tokens=b.output_tokens,
    )


def _empty(start: float) -> SeriesPoint:
    return SeriesPoint(
        start=start,
        calls=0,
        calls_per_second=0.0,
        errors=0,
        latency_mean_seconds=None,
        latency_max_seconds=None,
        ttft_mean_seconds=None,
        input_tokens=0,
        output_tokens=0,
    )
