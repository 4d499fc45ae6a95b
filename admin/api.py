"""The control plane as one router: every ``/admin/v1`` route, behind the admin token.

``extra`` routers are mounted the same way: the composition root passes those of the protocol rooms that
add admin resources (the Osmosis agent servers' ``/admin/v1/agents``), so this package imports none of them.
"""

from __future__ import annotations

from collections.abc import Iterable

from fastapi import APIRouter, Depends

from rollway.admin import exports, keys, models, replicas, resources, rollouts, stats, triplets, updates
from rollway.admin.auth import require_admin


def build_router(extra: Iterable[APIRouter] = ()) -> APIRouter:
    router = APIRouter(prefix="/admin/v1", dependencies=[Depends(require_admin)])
    subs = (rollouts, resources, models, updates, keys, stats, triplets, replicas)
    for sub in (module.router for module in subs):
        router.include_router(sub)
    for sub in extra:
        router.include_router(sub)
    router.include_router(exports.router)
    return router
