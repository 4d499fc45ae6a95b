"""The mock backend's control plane, for tests and benchmarks: script faults (``/mock/faults``), reset the state
(``/mock/reset``), read the bookkeeping (``/mock/stats``, ``/mock/requests``) and change the knobs
(``/mock/config``)."""

from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rollway.envelope import envelope
from rollway.mock.faults import FaultError
from rollway.mock.state import MockState


def control_routes(state: MockState) -> list[Route]:
    """``/mock/faults``, ``/mock/reset``, ``/mock/stats``, ``/mock/requests`` and ``/mock/config``."""

    async def faults(request: Request) -> Response:
        if request.method == "DELETE":
            state.faults.clear()
        elif request.method == "POST":
            try:
                added = state.faults.add(await request.json())
            except (FaultError, json.JSONDecodeError) as exc:
                return JSONResponse(envelope(str(exc), "invalid_request_error"), status_code=400)
            return JSONResponse(
                {"added": [r.as_dict() for r in added], "rules": [r.as_dict() for r in state.faults.rules]}
            )
        return JSONResponse({"rules": [r.as_dict() for r in state.faults.rules]})

    async def reset(_: Request) -> Response:
        state.reset()
        return JSONResponse({"status": "reset"})

    async def stats(request: Request) -> Response:
        query = request.query_params
        try:
            timeout = min(float(query.get("timeout", "5")), 60.0)
            want_cancelled = int(query.get("wait_cancelled", "0"))
            want_requests = int(query.get("wait_requests", "0"))
            want_idle = query.get("wait_idle", "0") not in ("0", "", "false")
        except ValueError:
            return JSONResponse(envelope("bad query parameter", "invalid_request_error"), status_code=400)
        s = state.stats
        if want_cancelled or want_requests or want_idle:
            await s.wait_until(
                lambda: (
                    len(s.cancelled) >= want_cancelled
                    and sum(s.requests.values()) >= want_requests
                    and (not want_idle or not s.in_flight)
                ),
                timeout,
            )
        return JSONResponse(s.snapshot())

    async def requests(request: Request) -> Response:
        try:
            limit = int(request.query_params.get("limit", "100"))
        except ValueError:
            return JSONResponse(envelope("limit must be an integer", "invalid_request_error"), status_code=400)
        path = request.query_params.get("path")
        items = [r for r in state.stats.log if path is None or r["path"] == path]
        return JSONResponse({"requests": items[-limit:] if limit > 0 else []})

    async def config(request: Request) -> Response:
        if request.method == "POST":
            try:
                changes = await request.json()
                if not isinstance(changes, dict):
                    raise ValueError("send an object of config keys")
                state.set_config(state.config.updated(changes))
            except ValueError as exc:
                return JSONResponse(envelope(str(exc), "invalid_request_error"), status_code=400)
        return JSONResponse(state.config.as_dict())

    return [
        Route("/mock/faults", faults, methods=["GET", "POST", "DELETE"]),
        Route("/mock/reset", reset, methods=["POST"]),
        Route("/mock/stats", stats, methods=["GET"]),
        Route("/mock/requests", requests, methods=["GET"]),
        Route("/mock/config", config, methods=["GET", "POST"]),
    ]
