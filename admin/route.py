"""The admin API's route class (every ``/admin/v1`` router uses it): a request body that is not JSON is refused
with a message that says so, and so is a body that is JSON but not an object.

FastAPI reports such a body as a validation error at ``("body", <character position>)`` with the message "JSON
decode error", which the app's one validation handler would show as ``"1: JSON decode error"``, ``param "1"``.
Here it becomes an error about the whole body (``param`` null) that names what the parser found; the handler
still builds the envelope. The data plane's routes are not the admin API's, and are left as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

_NOT_AN_OBJECT = {"model_attributes_type", "dict_type"}
_JSON_NAMES = {list: "an array", str: "a string", bytes: "text that is not JSON", int: "a number", float: "a number"}
_JSON_NAMES |= {bool: "true or false", type(None): "null"}


def _readable(exc: RequestValidationError) -> RequestValidationError:
    errors = exc.errors()
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
            try:
                return await handler(request)
            except RequestValidationError as exc:
                readable = _readable(exc)
                if readable is exc:
                    raise
                raise readable from exc

        return route
