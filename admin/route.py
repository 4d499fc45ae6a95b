"""The route class of the routes behind a credential (every ``/admin/v1`` router, Agent-lightning's ``/v1/agl``
and the Osmosis callback use it): the credential is checked before the body, and a request body that is not
JSON is refused with a message that says so, and so is a body that is JSON but not an object.

FastAPI parses a JSON body before it runs the route's dependencies (its auth), which would tell a caller without a
credential that its body did not parse (400) before telling it that it may not ask (401). Here the parse error
waits: the body is handed to FastAPI as ``NotJson``, which fails the body's validation, and FastAPI raises that
only once the dependencies ran. FastAPI reports such a body at ``("body", <character position>)`` with the message
"JSON decode error", which the app's one validation handler would show as ``"1: JSON decode error"``, ``param
"1"``; here it becomes an error about the whole body (``param`` null) that names what the parser found; the
handler still builds the envelope. The data plane's routes are not these, and are left as they are.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

_NOT_AN_OBJECT = {"model_attributes_type", "dict_type"}
_JSON_NAMES = {list: "an array", str: "a string", bytes: "text that is not JSON", int: "a number", float: "a number"}
_JSON_NAMES |= {bool: "true or false", type(None): "null"}


class NotJson:
    """A request body that did not parse as JSON, standing in for it until the route's dependencies ran. It fails
    the validation of any body: FastAPI validates bodies from attributes too (a model whose fields all have
    defaults would take any object), and each field read from this one is an error. A route with several body
    parameters looks each up with ``.get``, which fails as it does on a body that is not an object, so FastAPI
    reports those fields missing; the route then answers with the parse error (``_CredentialFirst.unparsed``)."""

    __slots__ = ("_at", "_why")  # (names no body has: a field of that name would be read from them)

    def __init__(self, error: json.JSONDecodeError) -> None:
        self._why = error.msg
        self._at = error.pos

    def __getattr__(self, name: str) -> Any:
        if name == "get":
            raise AttributeError(name)
        raise ValueError("the request body is not valid JSON")


class _CredentialFirst(Request):
    """The request as the route sees it: a body that is not JSON reads as ``NotJson`` (kept as ``unparsed``)
    instead of raising."""

    unparsed: NotJson | None = None

    async def json(self) -> Any:
        try:
            return await super().json()
        except json.JSONDecodeError as exc:
            self.unparsed = NotJson(exc)
            return self.unparsed


def _not_json(error: NotJson) -> RequestValidationError:
    message = f"the request body is not valid JSON: {error._why} (at character {error._at})"
    return RequestValidationError([{"type": "json_invalid", "loc": ("body",), "msg": message, "input": {}}])


def _readable(exc: RequestValidationError) -> RequestValidationError:
    errors = exc.errors()
    unparsed = next((e["input"] for e in errors if isinstance(e.get("input"), NotJson)), None)
    if unparsed is not None:
        return _not_json(unparsed)
    first = errors[0] if errors else {}
    if first.get("type") in _NOT_AN_OBJECT and tuple(first.get("loc", ())) == ("body",):
        got = _JSON_NAMES.get(type(first.get("input")), "something else")
        message = f"the request body must be a JSON object, got {got}"
        return RequestValidationError([{"type": first["type"], "loc": ("body",), "msg": message, "input": {}}])
    if first.get("type") != "json_invalid":
        return exc
    position = next((p for p in first.get("loc", ())[1:] if isinstance(p, int)), None)
    reason = (first.get("ctx") or {}).get("error") or "it could not be parsed"
    where = "" if position is None else f" (at character {position})"
    message = f"the request body is not valid JSON: {reason}{where}"
    return RequestValidationError([{"type": "json_invalid", "loc": ("body",), "msg": message, "input": {}}])


class AdminRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            asked = _CredentialFirst(request.scope, request.receive, request._send)
            try:
                return await handler(asked)
            except RequestValidationError as exc:
                readable = _not_json(asked.unparsed) if asked.unparsed is not None else _readable(exc)
                if readable is exc:
                    raise
                raise readable from exc

        return route
