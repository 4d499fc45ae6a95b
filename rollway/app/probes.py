"""Operational endpoints: ``/healthz`` (alive), ``/readyz`` (store readable and writable, backends up/down; 503 when
asked on a connection past ``ROLLWAY_MAX_CONNECTIONS``, ``rollway.app.connections``) and ``/metrics`` (Prometheus
text format; open, or behind ``metrics_token`` when one is set)."""

from __future__ import annotations

import asyncio
import hmac
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from rollway.app.connections import SATURATED
from rollway.envelope import envelope
from rollway.gateway.metrics import CONTENT_TYPE

if TYPE_CHECKING:
    from rollway.app.state import AppState

READY_TIMEOUT = 2.0


def build_router() -> APIRouter:
    router = APIRouter(tags=["health"])

    @router.get("/healthz")
    async def healthz() -> dict[str, str]:
        """The process is alive."""
        return {"status": "ok"}

    @router.get("/readyz", response_model=None)
    async def readyz(request: Request) -> Any:
        """The store answers and takes writes (503 if not, within 2 s: a write failed in the last few seconds, or
        one has waited for the database's lock past a bound; ``Store.write_problem``); which backends this process
        routes to (up) or has ejected after failures (down). Readiness depends on the store only: a down backend
        is reported. Asked on a connection the server took past its connection cap, 503 at once: the process
        refuses new connections."""
        cap = request.scope.get("state", {}).get(SATURATED)
        if cap is not None:
            message = (
                f"saturated: this process holds its {cap} connections (ROLLWAY_MAX_CONNECTIONS) and refuses new ones"
            )
            return _not_ready(message, "too_many_connections")
        state = _state(request)
        try:
            async with asyncio.timeout(READY_TIMEOUT):
                await state.store.ping()
                problem = await state.store.write_problem()
                models = await state.store.list_models()
        except Exception as exc:
            return _not_ready(f"store unreachable: {type(exc).__name__}")
        if problem is not None:
            return _not_ready(f"store cannot write: {problem}")
        backends = {
            b.backend_id: "up" if state.router.is_up(b.backend_id) else "down" for m in models for b in m.backends
        }
        running, limit = state.gateway.running, state.settings.max_calls_in_flight
        calls = {"running": running.count, "limit": limit or None, "saturated": running.over(limit)}
        return {"status": "ready", "store": "ok", "backends": backends, "calls": calls}

    @router.get("/metrics", response_model=None)
    async def metrics(request: Request) -> Any:
        """Prometheus metrics (see docs/observability.md)."""
        state = _state(request)
        expected = state.settings.metrics_token
        if expected is not None and not _bearer_matches(request, expected.get_secret_value()):
            return JSONResponse(
                envelope("/metrics needs Authorization: Bearer <metrics token>", "authentication_error"),
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        await state.metrics.refresh(state.store)
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE)

    return router


def _not_ready(message: str, code: str | None = None) -> JSONResponse:
    return JSONResponse(envelope(message, "service_unavailable", code=code), status_code=503)


def _state(request: Request) -> AppState:
    state: AppState = request.app.state.rollway
    return state


def _bearer_matches(request: Request, expected: str) -> bool:
    value = request.headers.get("authorization", "")
    if value[:7].lower() != "bearer ":
        return False
    return hmac.compare_digest(value[7:].strip().encode(), expected.encode())
