"""Fake agent servers for the Osmosis tests: an aiohttp app on a loopback port with the routes a test gives it
(``serving``), a ``/health`` as a v1 or 0.3 server answers it (``health_route``), one task run to its end on a
gateway of its own (``one_task``), and the wait for rollouts to finish (``finish``)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
from aiohttp import web

from rollway.store import Attempt, Rollout
from support.gateway_harness import RunningGateway, running_gateway


async def finish(gw: RunningGateway, ids: list[str], timeout: float = 90) -> list[Rollout]:
    deadline = time.monotonic() + timeout
    while True:
        done, pending = await gw.store.wait_for_rollouts(ids, min(20.0, max(deadline - time.monotonic(), 0.1)))
        if not pending:
            by_id = {r.rollout_id: r for r in done}
            return [by_id[i] for i in ids]
        assert time.monotonic() < deadline, f"{len(pending)} rollouts still running, e.g. {pending[:3]}"


def health_route(protocol: str = "0.3") -> web.RouteDef:
    """``GET /health`` as a server of ``protocol`` answers it (a 0.3 server's names its process and lifecycle)."""
    lifecycle = {"process_id": "p-1", "lifecycle": "ready"} if protocol == "0.3" else {}

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", **lifecycle})

    return web.get("/health", health)


async def one_task(tmp_path: Path, url: str, name: str, timeout: float = 30, **agent: Any) -> tuple[Rollout, Attempt]:
    """One task (``ro-<name>``) for the agent server at ``url``, registered as ``name`` (with ``agent``'s other
    fields) on a gateway of its own, run to its end: the rollout and its one attempt."""
    async with running_gateway(tmp_path) as gw, httpx.AsyncClient(base_url=gw.url) as admin:
        await admin.put(f"/admin/v1/agents/{name}", json={"url": url, **agent})
        task = {"rollout_id": f"ro-{name}", "input": "x", "agent": name}
        await admin.post("/admin/v1/rollouts", json={"tasks": [task]})
        [rollout] = await finish(gw, [f"ro-{name}"], timeout=timeout)
        [attempt] = await gw.store.list_attempts(f"ro-{name}")
    return rollout, attempt


@contextlib.asynccontextmanager
async def serving(*routes: web.RouteDef) -> AsyncIterator[str]:
    """An aiohttp app on a free loopback port with ``routes``: its base URL."""
    app = web.Application()
    app.add_routes(routes)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    finally:
        await runner.cleanup()
