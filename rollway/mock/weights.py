"""The mock's weight routes, as the engines answer them (``rollway.gateway.weights`` drives them).

- ``vllm`` flavour, with ``dev_mode`` (vLLM's ``VLLM_SERVER_DEV_MODE=1``; without it these paths are 404s):
  ``POST /pause`` (``?mode=abort|wait|keep``), ``POST /resume``, ``GET /is_paused``, ``POST /collective_rpc``
  (``reload_weights`` only), ``POST /update_weight_version {"new_version"}`` and ``GET /weight_info``. The weight
  version starts as ``"default"``, as vLLM's does. While paused, generation requests wait for the resume.
- ``sglang`` flavour: ``POST /update_weights_from_disk {"model_path", "weight_version"?}`` and
  ``GET /get_weight_version``.

A reload changes the fake model's answers (``FakeModel.weights``), so a test can tell which weights served a call.
Fault rules (``/mock/faults``) apply to these paths too: a ``status`` rule makes a reload fail as an engine would.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from rollway.mock.state import MockState

PAUSE_MODES = ("abort", "wait", "keep")


def weight_routes(state: MockState) -> list[Route]:
    """The flavour's weight routes (none for ``vllm`` without ``dev_mode``)."""
    if state.config.flavor == "sglang":
        return [
            Route("/update_weights_from_disk", _guarded(state, _sglang_update(state)), methods=["POST"]),
            Route("/get_weight_version", _guarded(state, _version(state)), methods=["GET"]),
        ]
    if not state.config.dev_mode:
        return []
    return [
        Route("/pause", _guarded(state, _pause(state)), methods=["POST"]),
        Route("/resume", _guarded(state, _resume(state)), methods=["POST"]),
        Route("/is_paused", _guarded(state, _is_paused(state)), methods=["GET"]),
        Route("/collective_rpc", _guarded(state, _rpc(state)), methods=["POST"]),
        Route("/update_weight_version", _guarded(state, _set_version(state)), methods=["POST"]),
        Route("/weight_info", _guarded(state, _version(state)), methods=["GET"]),
    ]


Handler = Any


def _guarded(state: MockState, handler: Handler) -> Handler:
    """``handler`` behind the fault rules and the request log, as the data plane's routes are."""

    async def endpoint(request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else None
        except json.JSONDecodeError:
            return JSONResponse({"detail": "JSON decode error"}, status_code=400)
        state.stats.log.append(
            {"method": request.method, "path": request.url.path, "query": request.url.query, "body": body}
        )
        rule = state.faults.take(path=request.url.path, model=None, stream=False)
        if rule is not None and rule.kind in ("status", "rate_limit"):
            return JSONResponse(rule.body or {"error": "mock: fault"}, status_code=rule.status, headers=rule.headers)
        result: Response = await handler(request, body)
        return result

    return endpoint


def _pause(state: MockState) -> Handler:
    async def pause(request: Request, _: Any) -> Response:
        mode = request.query_params.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return JSONResponse({"detail": f"mode must be one of {', '.join(PAUSE_MODES)}"}, status_code=422)
        state.engine_resumed.clear()
        return JSONResponse({"status": "paused"})

    return pause


def _resume(state: MockState) -> Handler:
    async def resume(_: Request, __: Any) -> Response:
        state.engine_resumed.set()
        return JSONResponse({"status": "resumed"})

    return resume


def _is_paused(state: MockState) -> Handler:
    async def is_paused(_: Request, __: Any) -> Response:
        return JSONResponse({"is_paused": not state.engine_resumed.is_set()})

    return is_paused


def _rpc(state: MockState) -> Handler:
    async def rpc(_: Request, body: Any) -> Response:
        if not isinstance(body, dict):
            return JSONResponse({"detail": "Request body must be a JSON object"}, status_code=400)
        method = body.get("method")
        if method is None:
            return JSONResponse({"detail": "Missing 'method' in request body"}, status_code=400)
        if method != "reload_weights":
            return PlainTextResponse("Internal Server Error", status_code=500)  # the worker has no such method
        kwargs = body.get("kwargs") or {}
        state.reload(kwargs.get("weights_path") if isinstance(kwargs, dict) else None)
        return JSONResponse({"results": [None]})

    return rpc


def _set_version(state: MockState) -> Handler:
    async def set_version(_: Request, body: Any) -> Response:
        version = body.get("new_version") if isinstance(body, dict) else None
        if not isinstance(version, str):
            missing = [{"type": "missing", "loc": ["body", "new_version"], "msg": "Field required", "input": body}]
            return JSONResponse({"detail": missing}, status_code=422)
        state.weight_version = version
        return JSONResponse({"success": True, "new_version": version})

    return set_version


def _version(state: MockState) -> Handler:
    async def version(_: Request, __: Any) -> Response:
        return JSONResponse({"weight_version": state.weight_version})

    return version


def _sglang_update(state: MockState) -> Handler:
    async def update(_: Request, body: Any) -> Response:
        path = body.get("model_path") if isinstance(body, dict) else None
        if not isinstance(path, str):
            return JSONResponse({"success": False, "message": "model_path is required"}, status_code=400)
        state.reload(path)
        version = body.get("weight_version")
        if isinstance(version, str):
            state.weight_version = version
        return JSONResponse(
            {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
        )

    return update
