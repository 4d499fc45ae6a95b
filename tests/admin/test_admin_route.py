"""``admin.route.AdminRoute``: a body that is not JSON is refused with the parse error once the route's
dependencies ran, on a route with one body parameter and on one with several (which FastAPI reads with ``.get``)."""

from __future__ import annotations

from typing import Annotated

import httpx
import pytest
from fastapi import APIRouter, Body, Depends, FastAPI, Header, HTTPException
from pydantic import BaseModel

from rollway.admin.route import AdminRoute
from rollway.app import errors


class Part(BaseModel):
    size: int = 1


def _credential(authorization: Annotated[str | None, Header()] = None) -> None:
    if authorization != "Bearer ok":
        raise HTTPException(401, "no credential")


def _app() -> FastAPI:
    router = APIRouter(route_class=AdminRoute, dependencies=[Depends(_credential)])

    @router.post("/one")
    async def one(part: Part) -> dict[str, int]:
        return {"size": part.size}

    @router.post("/two")
    async def two(first: Annotated[Part, Body()], second: Annotated[Part | None, Body()] = None) -> dict[str, int]:
        return {"size": first.size + (second or Part()).size}

    app = FastAPI()
    app.include_router(router)
    errors.install(app)
    return app


@pytest.mark.parametrize("path", ["/one", "/two"])
async def test_a_body_that_is_not_json_is_a_400_naming_the_parse_error_after_the_credential(path: str) -> None:
    transport = httpx.ASGITransport(app=_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        headers = {"content-type": "application/json"}
        assert (await http.post(path, content=b"{nope", headers=headers)).status_code == 401
        refused = await http.post(path, content=b"{nope", headers={**headers, "authorization": "Bearer ok"})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["message"].startswith("the request body is not valid JSON: "), error
        assert "(at character 1)" in error["message"] and error["param"] is None
        good = {"size": 2} if path == "/one" else {"first": {"size": 2}}
        answered = await http.post(path, json=good, headers={"authorization": "Bearer ok"})
        assert answered.status_code == 200 and answered.json() == {"size": 2 if path == "/one" else 3}
