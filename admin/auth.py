"""Admin authentication: ``Authorization: Bearer <admin token>`` whenever a token is configured.

No header, or a token nobody issued → 401; a real key of another scope (a gateway or rollout key) → 403.
Admin-scoped keys minted with ``POST /admin/v1/keys {"scope": "admin"}`` work like the admin token. Tokens are
compared in constant time and never logged or echoed.
"""

from __future__ import annotations

import hmac

from fastapi import HTTPException, Request

from rollway.admin.context import Context

CHALLENGE = {"WWW-Authenticate": "Bearer"}


def _bearer(request: Request) -> str | None:
    value = request.headers.get("authorization", "")
    if value[:7].lower() != "bearer ":
        return None
    return value[7:].strip() or None


async def require_admin(request: Request, context: Context) -> None:
    expected = context.admin_token
    if expected is None:
        request.state.admin_by = "loopback (no admin token)"
        return  # no token configured: the server only listens on loopback (enforced by `rollway serve`)
    token = _bearer(request)
    if token is None:
        raise HTTPException(401, "the admin API needs Authorization: Bearer <admin token>", headers=CHALLENGE)
    if hmac.compare_digest(token.encode(), expected.get_secret_value().encode()):
        request.state.admin_by = "admin token"
        return
    key = await context.store.find_key(token)
    if key is None:
        raise HTTPException(401, "invalid admin token", headers=CHALLENGE)
    if key.scope != "admin":
        raise HTTPException(403, f"a {key.scope} key cannot use the admin API")
    request.state.admin_by = f"admin key {key.key_id}" + (f" ({key.name})" if key.name else "")


def admin_by(request: Request) -> str:
    """Who the request's admin credential is (``require_admin`` ran first): what records of its changes name."""
    return str(getattr(request.state, "admin_by", "unknown"))
