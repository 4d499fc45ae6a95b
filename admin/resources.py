"""Versioned named resources (``/admin/v1/resources``)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from rollway.admin.context import Context
from rollway.admin.route import AdminRoute
from rollway.admin.schemas import ResourcesBody, ResourcesPage
from rollway.store import NotFoundError, ResourcesUpdate

router = APIRouter(tags=["resources"], route_class=AdminRoute)


@router.post("/resources", status_code=201, response_model=ResourcesUpdate)
async def add(body: ResourcesBody, context: Context) -> ResourcesUpdate:
    """A new bundle: new id, version 1; it becomes the latest."""
    return await context.store.add_resources(body.resources)


@router.get("/resources", response_model=ResourcesPage)
async def list_resources(
    context: Context, limit: Annotated[int, Query(ge=1, le=1000)] = 100, cursor: str | None = None
) -> ResourcesPage:
    page = await context.store.list_resources(limit, cursor)
    return ResourcesPage(items=page.items, next_cursor=page.next_cursor)


@router.get("/resources/latest", response_model=ResourcesUpdate)
async def latest(context: Context) -> ResourcesUpdate:
    found = await context.store.latest_resources()
    if found is None:
        raise NotFoundError("no resources have been added yet")
    return found


@router.get("/resources/{resources_id}", response_model=ResourcesUpdate)
async def get(resources_id: str, context: Context) -> ResourcesUpdate:
    return await context.store.get_resources(resources_id)


@router.put("/resources/{resources_id}", response_model=ResourcesUpdate)
async def update(resources_id: str, body: ResourcesBody, context: Context) -> ResourcesUpdate:
    """A new version (+1) of an existing bundle; it becomes the latest. An unknown id is a 404 (a new bundle
    is a `POST /resources`)."""
    return await context.store.update_resources(resources_id, body.resources, create=False)
