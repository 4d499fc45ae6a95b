"""The ``/v1/agl`` routes of Agent-lightning 0.3's store protocol, each a thin call into ``store.Store``.

Single-object reads answer ``200 null`` for a missing object (the client expects it); a field left out of an
update leaves it unchanged, an explicit ``null`` where Agent-lightning forbids one is a 400. Store errors
keep Rollway's mapping (404 unknown, 409 illegal transition or stale attempt, 400 invalid); the client does
not retry 4xx.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Body, Depends, Query, Request
from fastapi.responses import Response

from rollway.admin.context import Context
from rollway.admin.route import AdminRoute
from rollway.agl import otlp, queries, shapes
from rollway.agl.access import require_access
from rollway.agl.bodies import (
    AttemptQuery,
    AttemptUpdate,
    DequeueBody,
    NextBody,
    Order,
    Paging,
    RolloutQuery,
    RolloutUpdate,
    SpanQuery,
    StartBody,
    WaitBody,
    WorkerBody,
    WorkerQuery,
    WorkerUpdate,
    not_null,
    task_of,
)
from rollway.agl.listing import QueryError
from rollway.envelope import envelope
from rollway.store import NotFoundError

PREFIX = "/v1/agl"
MAX_WAIT = 60.0


def json(content: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(content), status_code=status, media_type="application/json")


def bad(message: str) -> Response:
    return json(envelope(message, "invalid_request_error"), 400)


# -- the router -----------------------------------------------------------------------------------------------


def build_router() -> APIRouter:
    # AdminRoute: the credential is checked before the body, whose parse error says what it is.
    router = APIRouter(
        prefix=PREFIX, dependencies=[Depends(require_access)], tags=["agent-lightning"], route_class=AdminRoute
    )

    @router.get("/health")
    async def health() -> Response:
        return json({"status": "ok"})

    @router.post("/queues/rollouts/enqueue")
    async def enqueue(request: Request, context: Context) -> Response:
        # Parsed by hand (one pydantic pass, into the store's own TaskSpec): this is a hot path for trainers.
        try:
            tasks = shapes.tasks(await _body(request))
        except shapes.ShapeError as exc:
            return bad(str(exc))
        rollouts = await context.store.enqueue(tasks)
        return json([shapes.rollout(r) for r in rollouts], 201)

    @router.post("/queues/rollouts/dequeue")
    async def dequeue(context: Context, body: Annotated[DequeueBody | None, Body()] = None) -> Response:
        wanted = body or DequeueBody()
        if wanted.limit <= 0:
            return json([])
        claimed = await context.store.claim(wanted.worker_id, min(wanted.limit, 1000))
        return json([shapes.attempted(a) for a in claimed])

    @router.post("/rollouts")
    async def start_rollout(body: StartBody, context: Context) -> Response:
        started = await context.store.start_rollout(task_of(body), body.worker_id)
        return json(shapes.attempted(started), 201)

    @router.get("/rollouts")
    async def query_rollouts(context: Context, query: Annotated[RolloutQuery, Query()]) -> Response:
        return await _answer(queries.rollouts(context.store, query))

    @router.post("/rollouts/search")
    async def search_rollouts(body: RolloutQuery, context: Context) -> Response:
        return await _answer(queries.rollouts(context.store, body))

    @router.get("/rollouts/{rollout_id}")
    async def get_rollout(rollout_id: str, context: Context) -> Response:
        try:
            found = await context.store.get_rollout(rollout_id)
        except NotFoundError:
            return json(None)
        latest = (await context.store.latest_attempts([rollout_id])).get(rollout_id)
        return json(shapes.rollout(found, latest))

    @router.post("/rollouts/{rollout_id}")
    async def update_rollout(rollout_id: str, body: RolloutUpdate, context: Context) -> Response:
        problem = not_null(body, "status", "config")
        if problem:
            return bad(problem)
        changes = {name: getattr(body, name) for name in body.model_fields_set}
        if "config" in changes:
            changes["config"] = body.config.model_dump(mode="json") if body.config else None
        updated = await context.store.update_rollout(rollout_id, changes)
        return json(shapes.rollout(updated))

    @router.post("/rollouts/{rollout_id}/attempts")
    async def start_attempt(
        rollout_id: str, context: Context, body: Annotated[WorkerBody | None, Body()] = None
    ) -> Response:
        started = await context.store.start_attempt(rollout_id, body.worker_id if body else None)
        return json(shapes.attempted(started), 201)

    @router.get("/rollouts/{rollout_id}/attempts")
    async def query_attempts(rollout_id: str, context: Context, query: Annotated[AttemptQuery, Query()]) -> Response:
        return await _answer(queries.attempts(context.store, rollout_id, query))

    @router.post("/rollouts/{rollout_id}/attempts/search")
    async def search_attempts(rollout_id: str, body: AttemptQuery, context: Context) -> Response:
        return await _answer(queries.attempts(context.store, rollout_id, body))

    @router.get("/rollouts/{rollout_id}/attempts/latest")
    async def latest_attempt(rollout_id: str, context: Context) -> Response:
        latest = (await context.store.latest_attempts([rollout_id])).get(rollout_id)
        return json(None if latest is None else shapes.attempt(latest))

    @router.post("/rollouts/{rollout_id}/attempts/{attempt_id}")
    async def update_attempt(rollout_id: str, attempt_id: str, body: AttemptUpdate, context: Context) -> Response:
        problem = not_null(body, "status", "worker_id", "last_heartbeat_time", "metadata")
        if problem:
            return bad(problem)
        store = context.store
        if "last_heartbeat_time" in body.model_fields_set:
            await store.heartbeat(rollout_id, attempt_id)
        extra: dict[str, Any] = {}
        if "metadata" in body.model_fields_set:
            extra["metadata"] = body.metadata
        if "worker_id" in body.model_fields_set:
            extra["worker_id"] = body.worker_id
        updated = await store.update_attempt(rollout_id, attempt_id, status=body.status, **extra)
        return json(shapes.attempt(updated))

    @router.get("/workers")
    async def query_workers(context: Context, query: Annotated[WorkerQuery, Query()]) -> Response:
        return await _answer(queries.workers(context.store, query))

    @router.post("/workers/search")
    async def search_workers(body: WorkerQuery, context: Context) -> Response:
        return await _answer(queries.workers(context.store, body))

    @router.get("/workers/{worker_id}")
    async def get_worker(worker_id: str, context: Context) -> Response:
        try:
            return json(shapes.worker(await context.store.get_worker(worker_id)))
        except NotFoundError:
            return json(None)

    @router.post("/workers/{worker_id}")
    async def update_worker(
        worker_id: str, context: Context, body: Annotated[WorkerUpdate | None, Body()] = None
    ) -> Response:
        if body is not None:
            problem = not_null(body, "heartbeat_stats")
            if problem:
                return bad(problem)
        set_stats = body is not None and "heartbeat_stats" in body.model_fields_set
        stats = body.heartbeat_stats if body is not None else None
        return json(shapes.worker(await context.store.worker_heartbeat(worker_id, stats, set_stats=set_stats)))

    @router.get("/statistics")
    async def statistics(context: Context) -> Response:
        stats = await context.store.stats()
        return json(
            {
                "name": "Rollway",
                "total_rollouts": stats.total_rollouts,
                "total_attempts": stats.total_attempts,
                "total_spans": stats.total_spans,
                "total_resources": stats.total_resources,
                "total_workers": stats.total_workers,
                "uptime": time.time() - context.started,
            }
        )

    @router.get("/resources")
    async def query_resources(
        context: Context,
        resources_id: str | None = None,
        resources_id_contains: str | None = None,
        limit: int = -1,
        offset: int = 0,
        sort_by: str | None = None,
        sort_order: Order = "asc",
    ) -> Response:
        query = Paging(limit=limit, offset=offset, sort_by=sort_by, sort_order=sort_order)
        return await _answer(queries.resources_page(context.store, query, resources_id, resources_id_contains))

    @router.post("/resources")
    async def add_resources(request: Request, context: Context) -> Response:
        try:
            named = shapes.named_resources(await _body(request))
        except shapes.ShapeError as exc:
            return bad(str(exc))
        return json(shapes.resources(await context.store.add_resources(named)), 201)

    @router.get("/resources/latest")
    async def latest_resources(context: Context) -> Response:
        latest = await context.store.latest_resources()
        return json(None if latest is None else shapes.resources(latest))

    @router.get("/resources/{resources_id}")
    async def get_resources(resources_id: str, context: Context) -> Response:
        try:
            return json(shapes.resources(await context.store.get_resources(resources_id)))
        except NotFoundError:
            return json(None)

    @router.post("/resources/{resources_id}")
    async def update_resources(resources_id: str, request: Request, context: Context) -> Response:
        try:
            named = shapes.named_resources(await _body(request))
        except shapes.ShapeError as exc:
            return bad(str(exc))
        return json(shapes.resources(await context.store.update_resources(resources_id, named)))

    @router.post("/spans")
    async def add_span(request: Request, context: Context) -> Response:
        try:
            body = await _body(request)
            span = shapes.span_in(body)
        except shapes.ShapeError as exc:
            return bad(str(exc))
        written = await context.store.add_span(span, shared_sequence=True)
        if written is None:
            return json(None, 201)
        # The span as the client sent it (Agent-lightning's shape), with its ids (the sequence id as sent).
        ids = {"rollout_id": written.rollout_id, "attempt_id": written.attempt_id, "sequence_id": span.sequence_id}
        return json({**body, **ids}, 201)

    @router.get("/spans")
    async def query_spans(context: Context, query: Annotated[SpanQuery, Depends()]) -> Response:
        return await _answer(queries.spans(context.store, query))

    @router.post("/spans/search")
    async def search_spans(body: SpanQuery, context: Context) -> Response:
        return await _answer(queries.spans(context.store, body))

    @router.post("/spans/next")
    async def next_sequence_id(body: NextBody, context: Context) -> Response:
        return json({"sequence_id": await context.store.next_sequence_id(body.rollout_id, body.attempt_id)})

    @router.post("/waits/rollouts")
    async def wait_for_rollouts(body: WaitBody, context: Context) -> Response:
        store = context.store
        wanted = list(dict.fromkeys(body.rollout_ids))
        if not wanted:
            return json([])
        known = (await store.list_rollouts(rollout_ids=wanted, limit=min(len(wanted), 10_000))).items
        ids = [r.rollout_id for r in known]
        if not ids:
            return json([])
        timeout = MAX_WAIT if body.timeout is None else min(max(body.timeout, 0.0), MAX_WAIT)
        done, _ = await store.wait_for_rollouts(ids, timeout)
        return json([shapes.rollout(r) for r in done])

    return router


async def _answer(pending: Any) -> Response:
    try:
        return json(await pending)
    except QueryError as exc:
        return bad(str(exc))


async def _body(request: Request) -> Any:
    try:
        return orjson.loads(await request.body())
    except orjson.JSONDecodeError:
        raise shapes.ShapeError("the body is not valid JSON") from None


def build_traces_router() -> APIRouter:
    """``POST /v1/traces``: OTLP/HTTP trace export (``agl.otlp``)."""
    router = APIRouter(dependencies=[Depends(require_access)], tags=["otlp"])

    @router.post("/v1/traces")
    async def traces(request: Request, context: Context) -> Response:
        try:
            kind = otlp.media_type(request.headers.get("content-type", ""))
            limit = _body_limit(request)
            declared = request.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > limit:
                raise otlp.OtlpError(f"the request body is larger than {limit} bytes", 413)
            raw = await request.body()
            if len(raw) > limit:
                raise otlp.OtlpError(f"the request body is larger than {limit} bytes", 413)
            body = otlp.decompress(raw, request.headers.get("content-encoding", ""), limit)
            message = otlp.parse(body, kind)
        except otlp.OtlpError as exc:
            return json(envelope(str(exc), "invalid_request_error"), exc.status)
        result = await otlp.ingest(context.store, message)
        return Response(otlp.response(result, kind), media_type=kind)

    return router


def _body_limit(request: Request) -> int:
    state = getattr(request.app.state, "rollway", None)
    settings = getattr(state, "settings", None)
    return int(getattr(settings, "max_body_bytes", 32 * 1024 * 1024))
