"""Model aliases and their backends (``/admin/v1/models``): put, delete, pause, resume, swap with drain.

The store keeps the configuration; the gateway's registry (``ModelControl``) applies it to calls: a paused
alias holds new calls, a swap is atomic for new calls while calls in flight finish where they started.
Backend API keys are accepted here and never returned.
"""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Query, Request, Response
from fastapi.responses import JSONResponse

from rollway.admin.auth import admin_by
from rollway.admin.context import AdminContext, Context
from rollway.admin.model_schemas import (
    CaptureView,
    DrainRequest,
    EngineVersionView,
    ModelPage,
    ModelPut,
    ModelView,
    SwapRequest,
    UpdatePage,
    UpdateRequest,
)
from rollway.admin.route import AdminRoute
from rollway.envelope import envelope
from rollway.store import ModelAlias, WeightUpdate
from rollway.store.sql.catalog import action_path

router = APIRouter(tags=["models"], route_class=AdminRoute)


async def view(context: AdminContext, model: ModelAlias, drained: bool | None = None) -> ModelView:
    counts = await context.models.in_flight_everywhere([model])
    answering = await context.models.reachable(model.backends)
    return _view(context, model, counts[model.alias], answering, drained)


def _view(
    context: AdminContext,
    model: ModelAlias,
    in_flight: tuple[int, int],
    answering: dict[str, bool],
    drained: bool | None = None,
) -> ModelView:
    """``answering``: whether each backend's address accepts a connection now; a backend is up when it does and
    the gateway routes to it (not ejected after failures), down when either is not so."""
    capture = context.models.capture(model.alias)
    seen = CaptureView(
        completions=capture.completions, untrainable=capture.untrainable, without_logprobs=capture.without_logprobs
    )
    detected = context.models.detected_kinds()
    routed = context.backend_up

    def up(backend_id: str) -> bool:
        return answering.get(backend_id, True) and (routed is None or routed(backend_id))

    view = ModelView.of(model, in_flight, drained, detected=detected, capture=seen, up=up)
    if context.engine_versions is not None:
        found = context.engine_versions(model.alias)
        view.engine_versions = {
            backend_id: EngineVersionView.model_validate(seen, from_attributes=True)
            for backend_id, seen in found.items()
        }
    return view


@router.get("/models", response_model=ModelPage)
async def list_models(context: Context) -> ModelPage:
    models = await context.store.list_models()
    counts = await context.models.in_flight_everywhere(models)
    answering = await context.models.reachable([b for m in models for b in m.backends])
    return ModelPage(items=[_view(context, m, counts[m.alias], answering) for m in models])


@router.post("/models/{alias:path}/pause", response_model=ModelView)
async def pause(alias: str, context: Context) -> ModelView:
    """New calls wait (up to the pause bound, then 429 + Retry-After); calls in flight go on."""
    return await view(context, await context.models.pause(alias))


@router.post("/models/{alias:path}/resume", response_model=ModelView)
async def resume(alias: str, context: Context) -> ModelView:
    return await view(context, await context.models.resume(alias))


@router.post("/models/{alias:path}/swap", response_model=ModelView)
async def swap(alias: str, body: SwapRequest, context: Context) -> ModelView:
    """Install new backends and/or a new version for new calls; with `drain_timeout_seconds`, also wait until
    the calls still running on an earlier configuration, in every gateway replica, have finished (`drained`
    says whether they did in time; `state.in_flight_old` counts those left)."""
    model, drained = await context.models.swap(
        alias, body.backends, version=body.version, drain_timeout=body.drain_timeout_seconds
    )
    return await view(context, model, drained)


@router.post("/models/{alias:path}/drain", response_model=ModelView)
async def drain(alias: str, context: Context, body: DrainRequest | None = None) -> ModelView:
    """Wait until no call of the alias is in flight in any gateway replica, up to `timeout_seconds` (`drained`
    says whether that happened). Pause first: otherwise new calls keep arriving."""
    drained = await context.models.drain(alias, (body or DrainRequest()).timeout_seconds)
    return await view(context, await context.store.get_model(alias), drained)


@router.post(
    "/models/{alias:path}/updates",
    response_model=WeightUpdate,
    responses={201: {"model": WeightUpdate}, 502: {"description": "the update failed; resumed on the old version"}},
)
async def update_weights(alias: str, body: UpdateRequest, request: Request, context: Context) -> Response:
    """Update the alias's weights as one operation: hold its new calls, drain (or abort) the calls in flight,
    reload, give it the new version, resume. `form: reload` (the default) asks the engines to reload in place and
    answers when the update has ended: 200 committed, or 502 failed with the update's record beside the error,
    resumed on the old version. `form: trainer` answers 201 once the alias is held and drained, for the trainer
    to move the weights and then commit (`POST /admin/v1/updates/{id}/commit`)."""
    by = admin_by(request)
    if body.form == "trainer":
        update = await context.updates.begin(alias, body.plan(), by)
    else:
        update = await context.updates.run(alias, body.plan(), by)
    return update_answer(update, opened=201 if body.form == "trainer" else 200)


@router.get("/models/{alias:path}/updates", response_model=UpdatePage)
async def list_updates(alias: str, context: Context, limit: int = Query(20, ge=1, le=500)) -> UpdatePage:
    """The alias's weight updates, newest first."""
    await context.store.get_model(alias)  # 404 for an alias that does not exist
    return UpdatePage(items=await context.store.list_updates(alias, limit))


def update_answer(update: WeightUpdate, opened: int = 200) -> Response:
    """An update as its caller is told: its record; a failed or expired one as a 502 with the record beside the
    error, so a script that checks the status does not go on as if the weights had changed."""
    record = update.model_dump(mode="json")
    if update.state in ("failed", "expired"):
        message = f"weight update {update.update_id} of '{update.alias}' {update.state}: {update.error}"
        return JSONResponse({**envelope(message, "upstream_error", code="weight_update_failed"), "update": record}, 502)
    return JSONResponse(record, status_code=opened if update.state == "open" else 200)


# After the routes with a suffix: an alias may contain '/' ("Qwen/Qwen2.5-7B"), so these match any rest of the
# path, and a POST to .../pause must not be read as a model named "<alias>/pause". Another method on an action
# path is a 405 (the store refuses such aliases), not a PUT that creates "<alias>/pause".
def _not_an_action(method: str, alias: str) -> None:
    if (action := action_path(alias)) is not None:
        head, last = action
        raise HTTPException(405, f"'{last}' is an action on model '{head}': use POST, not {method}", {"Allow": "POST"})


@router.get("/models/{alias:path}", response_model=ModelView)
async def get_model(alias: str, context: Context) -> ModelView:
    _not_an_action("GET", alias)
    return await view(context, await context.store.get_model(alias))


@router.put("/models/{alias:path}", response_model=ModelView)
async def put_model(alias: str, body: ModelPut, context: Context) -> ModelView:
    """Create or replace an alias (a replaced alias gets version + 1 unless one is given)."""
    _not_an_action("PUT", alias)
    model = await context.models.put(alias, body.backends, version=body.version, sampling=body.sampling)
    return await view(context, model)  # it shows each ``auto`` backend's engine, asked as the alias was put


@router.delete("/models/{alias:path}", status_code=204)
async def delete_model(alias: str, context: Context) -> Response:
    _not_an_action("DELETE", alias)
    await context.models.delete(alias)
    return Response(status_code=204)
