"""The control plane as one router: every ``/admin/v1`` route, behind the admin token."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from admin import agents, exports, keys, models, resources, rollouts, stats, triplets
from admin.auth import require_admin


def build_router() -> APIRouter:
    router = APIRouter(prefix="/admin/v1", dependencies=[Depends(require_admin)])
    for module in (rollouts, resources, models, keys, stats, triplets, agents, exports):
        router.include_router(module.router)
    return router
