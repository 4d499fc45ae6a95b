"""Gateway and admin API keys (``/admin/v1/keys``): minted keys are shown once and stored as digests."""

from __future__ import annotations

import time

from fastapi import APIRouter, Response

from rollway.admin.context import Context
from rollway.admin.route import AdminRoute
from rollway.admin.schemas import KeyRequest, MintedKey

router = APIRouter(tags=["keys"], route_class=AdminRoute)


@router.post("/keys", status_code=201, response_model=MintedKey)
async def mint(body: KeyRequest, context: Context) -> MintedKey:
    expires = None if body.expires_in_seconds is None else time.time() + body.expires_in_seconds
    record, key = await context.store.mint_key(body.scope, name=body.name, expires_time=expires)
    return MintedKey(key_id=record.key_id, key=key, scope=record.scope)


@router.delete("/keys/{key_id}", status_code=204)
async def revoke(key_id: str, context: Context) -> Response:
    await context.store.revoke_key(key_id)
    context.keys.forget(key_id)
    return Response(status_code=204)
