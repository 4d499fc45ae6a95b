"""Who may use ``/v1/agl/...`` and ``/v1/traces``.

Agent-lightning's client sends no headers, so besides ``Authorization: Bearer <admin token>`` the admin token
is accepted as a path prefix: ``http://host:8080/t/<token>`` as the client's address serves
``/t/<token>/v1/agl/...`` and ``/t/<token>/v1/traces``. ``PathToken`` (pure ASGI, outermost) checks the token
in constant time, strips the prefix and marks the request; the token is never logged or echoed. Without a
configured admin token the plain routes answer loopback clients only.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson
from fastapi import HTTPException, Request
from pydantic import SecretStr

from rollway.admin.auth import require_admin
from rollway.admin.context import context_of
from rollway.envelope import envelope

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]

PREFIX = re.compile(r"^/t/(?P<token>[^/]+)(?P<rest>/v1/(?:agl(?:/.*)?|traces/?))$")
VERIFIED = "rollway.path_token"


def _reject(status: int, message: str) -> tuple[int, bytes]:
    kind = "authentication_error" if status == 401 else "not_found_error"
    return status, orjson.dumps(envelope(message, kind))


class PathToken:
    """Serve ``/t/<admin token>/v1/agl/...`` and ``/t/<admin token>/v1/traces`` as the plain paths."""

    def __init__(self, app: ASGIApp, admin_token: SecretStr | None) -> None:
        self.app = app
        self.admin_token = admin_token

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/t/"):
            await self.app(scope, receive, send)
            return
        match = PREFIX.match(scope["path"])
        expected = self.admin_token if match else None
        if match is None:
            status, body = _reject(404, "not found")
        elif expected is None:
            status, body = _reject(401, "no admin token is configured: use the plain /v1/agl address on loopback")
        elif not hmac.compare_digest(match["token"].encode(), expected.get_secret_value().encode()):
            status, body = _reject(401, "invalid admin token in the path")
        else:
            # In place: the server's access log reads this same scope, so the token never reaches the log.
            rest = match["rest"]
            scope["path"] = rest
            scope["raw_path"] = rest.encode()
            scope[VERIFIED] = True
            await self.app(scope, receive, send)
            return
        # Refused: whatever stood where a token goes is not logged either (a right token on a route it does not
        # open, or a wrong one).
        _, slash, rest = scope["path"][len("/t/") :].partition("/")
        scope["path"] = "/t/redacted" + slash + rest
        scope["raw_path"] = scope["path"].encode()
        await send(
            {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]}
        )
        await send({"type": "http.response.body", "body": body})


def _loopback(request: Request) -> bool:
    host = request.client.host if request.client else ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def require_access(request: Request) -> None:
    """A verified path token, or the admin API's own check; with no admin token, loopback clients only."""
    if request.scope.get(VERIFIED):
        return
    context = context_of(request)
    if context.admin_token is None:
        if not _loopback(request):
            raise HTTPException(403, "without an admin token these routes answer loopback clients only")
        return
    await require_admin(request, context)
