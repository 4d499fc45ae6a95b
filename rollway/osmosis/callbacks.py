"""``POST /v1/rollout/completed``: a remote agent server reports how its rollout ended (the Osmosis
remote-rollout protocol; Rollway plays TrainGate, see ``rollway.osmosis.dispatcher``).

Body (Osmosis ``RolloutResponse``): ``{rollout_id, status: COMPLETED|ERROR, final_messages, finish_reason,
error_message, reward, metrics}``. ``COMPLETED`` → the attempt succeeds, ``ERROR`` → it fails (and the rollout
retries per its config); a non-null ``reward`` becomes a ``rollway.reward`` span; the report (metrics, final
messages, finish reason, error) is kept in the attempt's metadata under ``completion``. A second report for
the same attempt changes nothing (200, ``"duplicate": true``). Unknown rollout → 404; an attempt that already
ended otherwise (timed out, replaced by a retry) → 409; all in the error envelope.

Auth: ``Authorization: Bearer <rk- key>`` — the rollout-scoped key the agent got in its init (it pins the
attempt, so a late report of an old attempt never lands on its retry) — or the admin token / an admin key
(the latest attempt). Without a bearer the report is accepted only when no admin token is configured (the
same openness as the admin API then has). The credential is checked before the body (``_caller``, a dependency,
and the route class ``AdminRoute``): a caller without one gets its 401 whatever it sent; which rollout a key may
report for (403) is checked once the body is read. This path is not one of the data-plane routes, so the ASGI data
plane hands it to FastAPI.
"""

from __future__ import annotations

import hmac
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Request

from rollway.admin.route import AdminRoute
from rollway.gateway.attribution import KeyCache, bearer
from rollway.settings import Settings
from rollway.store import ApiKey, RemoteCompletion, Store

router = APIRouter(tags=["osmosis"], route_class=AdminRoute)
CHALLENGE = {"WWW-Authenticate": "Bearer"}


def _parts(request: Request) -> tuple[Settings, Store, KeyCache]:
    state = request.app.state.rollway
    return state.settings, state.store, state.keys


#: Who reports: an admin (the admin token, an admin key, or anyone when no admin token is configured: None), or
#: the holder of a rollout key (its ``ApiKey``).
Caller = ApiKey | None


async def _caller(request: Request) -> Caller:
    """The report's credential, checked before its body: 401 when it is missing (and needed) or unknown."""
    settings, _, keys = _parts(request)
    token = bearer({k.lower(): v for k, v in request.headers.items()})
    admin = settings.admin_token
    if token is None:
        if admin is None:
            return None
        raise HTTPException(401, "send the rollout key: Authorization: Bearer rk-...", headers=CHALLENGE)
    if admin is not None and hmac.compare_digest(token.encode(), admin.get_secret_value().encode()):
        return None
    key = await keys.find(token)
    if key is None:
        raise HTTPException(401, "invalid, revoked or expired key", headers=CHALLENGE)
    return None if key.scope == "admin" else key


def _attempt_for(caller: Caller, report: RemoteCompletion) -> str | None:
    """The attempt the caller may report for (None: the latest), or 403."""
    if caller is None:
        return None
    if caller.scope != "rollout" or caller.rollout_id != report.rollout_id:
        raise HTTPException(403, "this key cannot report for this rollout")
    return caller.attempt_id


@router.post("/v1/rollout/completed")
async def rollout_completed(
    report: RemoteCompletion, request: Request, caller: Annotated[Caller, Depends(_caller)]
) -> dict[str, Any]:
    """A remote agent server's completion callback (see the module docstring)."""
    attempt_id = _attempt_for(caller, report)
    _, store, _ = _parts(request)
    attempt, duplicate = await store.complete_remote(report, attempt_id)
    return {
        "rollout_id": report.rollout_id,
        "attempt_id": attempt.attempt_id,
        "status": attempt.status.value,
        "duplicate": duplicate,
    }
