"""The listings of ``/v1/agl`` (rollouts, attempts, workers, spans, resources) in Agent-lightning's page shape,
filtered and sorted as its server does (``agl.listing``); rollouts are filtered, sorted and paged by the database
when the query allows it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from rollway.agl import shapes
from rollway.agl.bodies import AttemptQuery, Paging, RolloutQuery, SpanQuery, WorkerQuery
from rollway.agl.listing import check_paging, contains, exact, matches, page, within
from rollway.store import NotFoundError, Page, Store
from rollway.store.sql.reads import ROLLOUT_SORT_COLUMNS

ROLLOUT_SORT = ("rollout_id", "input", "start_time", "end_time", "mode", "resources_id", "status", "config", "metadata")
ATTEMPT_SORT = (
    "rollout_id",
    "attempt_id",
    "sequence_id",
    "start_time",
    "end_time",
    "status",
    "worker_id",
    "last_heartbeat_time",
    "metadata",
)
WORKER_SORT = (
    "worker_id",
    "status",
    "heartbeat_stats",
    "last_heartbeat_time",
    "last_dequeue_time",
    "last_busy_time",
    "last_idle_time",
    "current_rollout_id",
    "current_attempt_id",
)
RESOURCES_SORT = ("resources_id", "create_time", "update_time", "version", "resources")
SPAN_SORT = (
    "rollout_id",
    "attempt_id",
    "sequence_id",
    "trace_id",
    "span_id",
    "parent_id",
    "name",
    "status",
    "attributes",
    "events",
    "links",
    "start_time",
    "end_time",
    "context",
    "parent",
    "resource",
)


async def rollouts(store: Store, query: RolloutQuery) -> dict[str, Any]:
    filters = {
        "status": query.status_in,
        "rollout_ids": query.rollout_id_in,
        "id_contains": query.rollout_id_contains,
    }
    given = sum(value is not None for value in filters.values())
    if (query.filter_logic == "and" or given <= 1) and (query.sort_by is None or query.sort_by in ROLLOUT_SORT_COLUMNS):
        # The database filters, sorts and pages: a page of a large store costs a page, not the store.
        check_paging(ROLLOUT_SORT, query.sort_by, query.limit, query.offset)
        found, total = await store.sorted_rollouts(
            **filters,
            sort_by=query.sort_by,
            descending=query.sort_order == "desc",
            limit=None if query.limit == -1 else query.limit,
            offset=query.offset,
        )
        latest = await store.latest_attempts([r.rollout_id for r in found])
        items = [shapes.rollout(r, latest.get(r.rollout_id)) for r in found]
        return {"items": items, "limit": query.limit, "offset": query.offset, "total": total}
    # ``or`` across filters, or an order by a JSON field: filtered and sorted here, as Agent-lightning does.
    found = await _every(store.list_rollouts, 10_000)
    latest = await store.latest_attempts([r.rollout_id for r in found])
    items = [shapes.rollout(r, latest.get(r.rollout_id)) for r in found]
    predicates = []
    if query.status_in is not None:
        predicates.append(within("status", query.status_in))
    if query.rollout_id_in is not None:
        predicates.append(within("rollout_id", query.rollout_id_in))
    if query.rollout_id_contains is not None:
        predicates.append(contains("rollout_id", query.rollout_id_contains))
    items = [i for i in items if matches(i, predicates, query.filter_logic)]
    return paged(items, ROLLOUT_SORT, query)


def paged(items: list[dict[str, Any]], allowed: tuple[str, ...], query: Paging) -> dict[str, Any]:
    return page(
        items,
        allowed_sort=allowed,
        sort_by=query.sort_by,
        sort_order=query.sort_order,
        limit=query.limit,
        offset=query.offset,
    )


async def attempts(store: Store, rollout_id: str, query: AttemptQuery) -> dict[str, Any]:
    try:
        attempts = await store.list_attempts(rollout_id)
    except NotFoundError:
        attempts = []
    return paged([shapes.attempt(a) for a in attempts], ATTEMPT_SORT, query)


async def workers(store: Store, query: WorkerQuery) -> dict[str, Any]:
    items = [shapes.worker(w) for w in await store.list_workers()]
    predicates = []
    if query.status_in is not None:
        predicates.append(within("status", query.status_in))
    if query.worker_id_contains is not None:
        predicates.append(contains("worker_id", query.worker_id_contains))
    items = [i for i in items if matches(i, predicates, query.filter_logic)]
    return paged(items, WORKER_SORT, query)


async def spans(store: Store, query: SpanQuery) -> dict[str, Any]:
    attempt = query.attempt_id or "all"
    try:
        found = await store.query_spans(query.rollout_id, attempt)
    except NotFoundError:
        found = []
    items = [shapes.span(s) for s in found]
    predicates = []
    for field in ("trace_id", "span_id", "parent_id", "name"):
        value = getattr(query, field)
        if value is not None:
            predicates.append(exact(field, value))
        part = getattr(query, f"{field}_contains")
        if part is not None:
            predicates.append(contains(field, part))
    items = [i for i in items if matches(i, predicates, query.filter_logic)]
    if query.sort_by == "sequence_id" and attempt == "all":
        # Sequence ids count per attempt: attempt (the store's order), then the id shown (stable for shared ones).
        position = {aid: n for n, aid in enumerate(dict.fromkeys(i["attempt_id"] for i in items))}
        items.sort(key=lambda i: (position[i["attempt_id"]], i["sequence_id"]), reverse=query.sort_order == "desc")
        return paged(items, SPAN_SORT, query.model_copy(update={"sort_by": None}))
    return paged(items, SPAN_SORT, query)


async def resources_page(store: Store, query: Paging, resources_id: str | None, part: str | None) -> dict[str, Any]:
    found = await _every(store.list_resources, 1000)
    items = [shapes.resources(r) for r in found]
    if resources_id is not None:
        items = [i for i in items if i["resources_id"] == resources_id]
    if part is not None:
        items = [i for i in items if part in i["resources_id"]]
    return paged(items, RESOURCES_SORT, query)


T = TypeVar("T")


async def _every(listing: Callable[..., Awaitable[Page[T]]], per_page: int) -> list[T]:
    """Every item of a store listing (``list_rollouts``, ``list_resources``), page after page."""
    found: list[T] = []
    cursor: str | None = None
    while True:
        batch = await listing(limit=per_page, cursor=cursor)
        found.extend(batch.items)
        cursor = batch.next_cursor
        if cursor is None:
            return found
