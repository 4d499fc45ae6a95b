"""Weight updates by id (``/admin/v1/updates``): read one or the latest, and end one begun in the trainer form
(commit, abort). The updates themselves begin at ``POST /admin/v1/models/{alias}/updates`` (``admin.models``)."""

from __future__ import annotations

from fastapi import APIRouter, Query, Response

from rollway.admin.context import Context
from rollway.admin.model_schemas import AbortRequest, UpdatePage
from rollway.admin.models import update_answer
from rollway.admin.route import AdminRoute
from rollway.store import WeightUpdate

router = APIRouter(tags=["models"], route_class=AdminRoute)


@router.get("/updates", response_model=UpdatePage)
async def list_updates(context: Context, alias: str | None = None, limit: int = Query(20, ge=1, le=500)) -> UpdatePage:
    """The latest weight updates (of `alias`, when given), newest first."""
    return UpdatePage(items=await context.store.list_updates(alias, limit))


@router.get("/updates/{update_id}", response_model=WeightUpdate)
async def get_update(update_id: str, context: Context) -> WeightUpdate:
    return await context.store.get_update(update_id)


@router.post("/updates/{update_id}/commit", response_model=WeightUpdate)
async def commit(update_id: str, context: Context) -> Response:
    """End an open update: the alias gets its new version and resumes. 409 when it has ended already (expired,
    aborted): its calls then went on with the old version."""
    return update_answer(await context.updates.commit(update_id))


@router.post("/updates/{update_id}/abort", response_model=WeightUpdate)
async def abort(update_id: str, context: Context, body: AbortRequest | None = None) -> Response:
    """End an open update on the old version (the weights did not change, or were put back)."""
    return update_answer(await context.updates.abort(update_id, (body or AbortRequest()).reason))
