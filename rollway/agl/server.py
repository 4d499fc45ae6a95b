"""Agent-lightning 1.0's server API at the root: what its trainer (``AglRolloutManager``), its ``agl-controller``
and its agents call, served over Rollway's store (``store.controlled``), so every rollout, event and model survives
a restart and every process on the database serves the same.

Routes: ``/api/rollouts`` (create, list by state, the terminal log, get, patch, delete), the events of a rollout
(raw and ``format=triplet``), ``/api/models``, and ``/proxy/pause``, ``/proxy/resume``, ``/proxy/state``. The
agents' LLM calls (``/proxy/rollout/...``) are the data plane's (``gateway.controlled``).

Auth (``key_accepted``, which the proxy route checks too): with an admin token set, every route needs it (or an
admin-scoped key) as ``Authorization: Bearer`` or ``x-api-key``; otherwise 401 ``{"detail": "Invalid or missing
API key"}``. Errors are ``{"detail": ...}`` with Agent-lightning's statuses: 404 unknown rollout, 409 a transition
its table forbids, 422 a body or query it refuses.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, SecretStr, TypeAdapter, ValidationError

from rollway.admin.context import Context
from rollway.agl import events
from rollway.agl.listing import MAX_PAGING
from rollway.store import ApiKey, ModelAlias, NotFoundError
from rollway.store.controlled import (
    ControlledCreate,
    ControlledPatch,
    ControlledRollout,
    EngineModel,
    ProxyPause,
    View,
    alias_for,
    backends_of,
)
from rollway.store.errors import ConflictError, StoreValidationError


class DetailError(Exception):
    """An error answered as ``{"detail": ...}`` (``detail_error``, installed by the app)."""

    def __init__(self, status: int, detail: Any) -> None:
        super().__init__(str(detail))
        self.status = status
        self.detail = detail


async def detail_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, DetailError)
    return JSONResponse({"detail": exc.detail}, status_code=exc.status)


async def key_accepted(
    headers: Mapping[str, str], admin_token: SecretStr | None, find_key: Callable[[str], Awaitable[ApiKey | None]]
) -> bool:
    """Whether a request may use this API, its proxy route included (``gateway.controlled`` is handed this check by
    the composition root): the key, as ``Authorization: Bearer`` or else ``x-api-key``, is the admin token or an
    admin-scoped key (``find_key`` looks it up). With no admin token every request may: the server listens on
    loopback only."""
    if admin_token is None:
        return True
    value = headers.get("authorization", "")
    token = value[7:].strip() if value[:7].lower() == "bearer " else headers.get("x-api-key", "")
    if not token:
        return False
    if hmac.compare_digest(token.encode(), admin_token.get_secret_value().encode()):
        return True
    key = await find_key(token)
    return key is not None and key.scope == "admin"


async def require_key(request: Request, context: Context) -> None:
    if not await key_accepted(request.headers, context.admin_token, context.store.find_key):
        raise DetailError(401, "Invalid or missing API key")


# -- bodies, as Agent-lightning's schemas take them ---------------------------------------------------------------


class LocalConfig(BaseModel):
    agent_class: str | None = None
    env_map: dict[str, str] = Field(default_factory=dict)


class K8sConfig(BaseModel):
    job_template: str | None = None


class RolloutConfigBody(BaseModel):
    timeout_seconds: int = 3600
    local: LocalConfig | None = None
    k8s: K8sConfig | None = None


class MetadataBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    batch_idx: int | None = None
    sample_idx_in_batch: int | None = None


class CreateBody(BaseModel):
    input: Any
    is_train: bool = True
    config: RolloutConfigBody | None = None
    metadata: MetadataBody | None = None
    rollout_id: str | None = Field(default=None, min_length=1, max_length=128)


class StatusPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    state: View | None = None
    k8s_job_name: str | None = None
    last_attempt_id: str | None = Field(default=None, max_length=128)
    error_message: str | None = None


class PatchBody(BaseModel):
    status: StatusPatch | None = None


class EventBody(BaseModel):
    event_type: str = Field(min_length=1, max_length=256)
    data: dict[str, Any] = Field(default_factory=dict)


class PauseBody(BaseModel):
    retry_after_seconds: int = Field(default=5, ge=0, le=86_400)
    reason: str | None = None


async def _body(request: Request, adapter: TypeAdapter[Any]) -> Any:
    """The JSON body validated as Agent-lightning's server validates it: 422 with pydantic's errors otherwise."""
    try:
        return adapter.validate_json(await request.body())
    except ValidationError as exc:
        errors = [{"type": e["type"], "loc": ["body", *e["loc"]], "msg": e["msg"]} for e in exc.errors()]
        raise DetailError(422, errors) from None


def _views(request: Request) -> set[View]:
    """``state_in`` (required, repeated): 422 when missing or not one of the four states."""
    given = request.query_params.getlist("state_in")
    wrong = [v for v in given if v not in STATES]
    if not given or wrong:
        message = "Field required" if not given else f"Input should be one of {', '.join(STATES)}"
        raise DetailError(
            422, [{"type": "missing" if not given else "enum", "loc": ["query", "state_in"], "msg": message}]
        )
    return set(given)  # type: ignore[arg-type]


STATES: tuple[View, ...] = ("queuing", "running", "succeeded", "failed")
CREATE = TypeAdapter(list[CreateBody])
PATCH = TypeAdapter(PatchBody)
EVENT = TypeAdapter(EventBody)
MODELS = TypeAdapter(list[EngineModel])
PAUSE = TypeAdapter(PauseBody)


# -- shapes ------------------------------------------------------------------------------------------------------


def rollout_view(record: ControlledRollout) -> dict[str, Any]:
    rollout = record.rollout
    return {
        "rollout_id": rollout.rollout_id,
        "input": rollout.input,
        "is_train": record.is_train,
        "config": RolloutConfigBody.model_validate(record.config).model_dump(mode="json"),
        "metadata": MetadataBody.model_validate(rollout.metadata or {}).model_dump(mode="json"),
        "status": {
            "state": record.state,
            "k8s_job_name": record.k8s_job_name,
            "last_attempt_id": record.last_attempt_id,
            "error_message": record.error_message,
            "version": record.version,
            "created_at": record.created_time,
            "updated_at": record.updated_time,
        },
    }


def _data_id(record: ControlledRollout) -> str:
    given = record.rollout.input
    if isinstance(given, dict):
        return str(given.get("data_id") or given.get("instance_id") or "")
    return ""


async def _found(call: Any) -> Any:
    try:
        return await call
    except NotFoundError as exc:
        raise DetailError(404, exc.message) from None
    except ConflictError as exc:
        raise DetailError(409, exc.message) from None
    except StoreValidationError as exc:  # a body the store refuses (a number that is not finite): as pydantic's
        raise DetailError(422, [{"type": "value_error", "loc": ["body"], "msg": exc.message}]) from None


# -- routes ------------------------------------------------------------------------------------------------------


def build_router() -> APIRouter:
    router = APIRouter(dependencies=[Depends(require_key)], tags=["agent-lightning-1.0"])

    @router.post("/api/rollouts", status_code=201)
    async def create(request: Request, context: Context) -> Any:
        items = await _body(request, CREATE)
        made = await _found(
            context.store.create_controlled(
                [
                    ControlledCreate(
                        rollout_id=item.rollout_id,
                        input=item.input,
                        is_train=item.is_train,
                        config=(item.config or RolloutConfigBody()).model_dump(mode="json"),
                        metadata=(item.metadata or MetadataBody()).model_dump(mode="json"),
                    )
                    for item in items
                ]
            )
        )
        return [rollout_view(r) for r in made]

    @router.get("/api/rollouts")
    async def listing(request: Request, context: Context, limit: int = 500) -> Any:
        # A limit beyond what the database's LIMIT holds already means every rollout.
        limit = min(limit, MAX_PAGING)
        return [rollout_view(r) for r in await context.store.list_controlled(_views(request), limit)]

    @router.get("/api/rollouts/terminal")
    async def terminal(context: Context, after: int = 0, limit: int = 1000) -> Any:
        # A position beyond what the database's integers hold is past the log's end, as any later one is.
        after, limit = min(max(after, 0), MAX_PAGING), min(max(limit, 1), 100_000)
        page = await context.store.terminal_controlled(after, limit)
        items = [
            {"rollout_id": r.rollout.rollout_id, "state": r.state, "data_id": _data_id(r), "is_train": r.is_train}
            for r in page.items
        ]
        return {"items": items, "next_after": page.next_after, "total_terminal": page.total}

    @router.get("/api/rollouts/{rollout_id}")
    async def get(rollout_id: str, context: Context) -> Any:
        record, attempts = await _found(context.store.get_controlled(rollout_id))
        return {"rollout": rollout_view(record), "attempts": attempts}

    @router.patch("/api/rollouts/{rollout_id}")
    async def patch(rollout_id: str, request: Request, context: Context) -> Any:
        body = await _body(request, PATCH)
        status = body.status
        change = ControlledPatch() if status is None else ControlledPatch(**status.model_dump(exclude_unset=True))
        return rollout_view(await _found(context.store.patch_controlled(rollout_id, change)))

    @router.delete("/api/rollouts/{rollout_id}", status_code=204)
    async def delete(rollout_id: str, context: Context) -> Response:
        await context.store.delete_controlled(rollout_id)
        return Response(status_code=204)

    @router.post("/api/rollouts/{rollout_id}/attempt/{attempt_id}/events")
    async def post_event(rollout_id: str, attempt_id: str, request: Request, context: Context) -> Any:
        body = await _body(request, EVENT)
        when = await _found(context.store.add_controlled_event(rollout_id, attempt_id, body.event_type, body.data))
        return {
            "event_type": body.event_type,
            "rollout_id": rollout_id,
            "attempt_id": attempt_id,
            "timestamp": when,
            "data": body.data,
        }

    @router.get("/api/rollouts/{rollout_id}/events")
    async def read_events(
        rollout_id: str,
        context: Context,
        event_type: str | None = None,
        format: str | None = None,
        include_routed_experts: bool = True,
    ) -> Any:
        record, _ = await _found(context.store.get_controlled(rollout_id))
        spans = await context.store.query_spans(rollout_id)
        found = events.raw_events(record, spans, await context.store.engine_models(), event_type)
        if format == "triplet":
            found = events.triplet_events(found)
        if not include_routed_experts:
            found = events.without_routed_experts(found)
        return found

    @router.post("/api/models", status_code=201)
    async def register(request: Request, context: Context) -> Any:
        given = await _body(request, MODELS)
        # The store checks every alias before it keeps any endpoint: a refused one (a base URL no call could
        # reach) is a 422 that changes nothing, and then no alias is put. While the proxy is paused, the models'
        # aliases are held like those the pause paused, an alias created now included (``Store.put_model``).
        _install(context, await _found(context.store.put_engine_models(given)))
        registered = await context.store.engine_models()
        for name in sorted({m.model for m in given}):
            version = str(max(m.version for m in registered if m.model == name))
            await _found(context.models.put(alias_for(name), backends_of(name, registered), version=version))
        context.proxy_changed()
        return [m.model_dump() for m in given]

    @router.delete("/api/models")
    async def unregister(context: Context) -> Any:
        await context.store.delete_engine_models()  # the aliases stay: their pause and their spans' names
        context.proxy_changed()
        return {"status": "ok"}

    @router.post("/proxy/pause")
    async def pause(request: Request, context: Context) -> Any:
        body = await _body(request, PAUSE)
        state, paused = await context.store.pause_proxy(body.retry_after_seconds, body.reason)
        context.proxy_changed()
        _install(context, paused)
        return await _state(context, state)

    @router.post("/proxy/resume")
    async def resume(context: Context) -> Any:
        state, resumed = await context.store.resume_proxy()
        context.proxy_changed()
        _install(context, resumed)  # its calls waiting on them go on at once
        return await _state(context, state)

    @router.get("/proxy/state")
    async def state(context: Context) -> Any:
        return await _state(context, await context.store.proxy_pause())

    return router


def _install(context: Context, changed: list[ModelAlias]) -> None:
    """Hand aliases the pause paused or resumed to this process's registry; other replicas see the catalog
    revision move (a replica that has not seen the pause yet holds its calls: the aliases are paused in the
    store)."""
    for model in changed:
        context.models.install(model.alias, model)


async def _state(context: Context, state: ProxyPause) -> dict[str, Any]:
    """The pause and the calls of the registered models in flight in every replica.

    While paused, the count is a drain's (the trainer's ends at the first 0 it reads): another replica counts
    as in flight until it reports after the catalog's latest change (the pause moved it; every replica reports
    within ``rollway.app.replicas.TICK`` of a change), and so do reports that cannot be read. A report older
    than the pause may miss a call that read the catalog before it."""
    aliases = set(state.aliases) | {alias_for(m.model) for m in await context.store.engine_models()}
    known = []
    for alias in sorted(aliases):
        try:
            known.append(await context.store.get_model(alias))
        except NotFoundError:
            continue
    since = await context.store.catalog_revision() if state.paused else None
    counts = await context.models.in_flight_everywhere(known, since=since) if known else {}
    return {
        "paused": state.paused,
        "retry_after_seconds": state.retry_after_seconds,
        "reason": state.reason,
        "inflight": sum(n for n, _ in counts.values()),
    }
