"""A real gateway (uvicorn on a loopback port, in the test's event loop, SQLite file) in front of the real
mock backend process, for end-to-end tests with the official ``openai`` SDK."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI
from openai import AsyncOpenAI

from rollway.app.factory import AppState, create_app
from rollway.mock import MockBackendProcess
from rollway.settings import Settings
from rollway.store import Store


@dataclass
class RunningGateway:
    url: str
    app: FastAPI
    clients: list[AsyncOpenAI] = field(default_factory=list)

    @property
    def state(self) -> AppState:
        state: AppState = self.app.state.rollway
        return state

    @property
    def store(self) -> Store:
        return self.state.store

    def client(self, base_url: str | None = None, api_key: str = "unused", **kwargs: Any) -> AsyncOpenAI:
        client = AsyncOpenAI(base_url=base_url or f"{self.url}/v1", api_key=api_key, max_retries=0, **kwargs)
        self.clients.append(client)
        return client


class _QuietServer(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # the test runner owns signals
        return None


@asynccontextmanager
async def running_gateway(tmp_path: Path, **settings: Any) -> AsyncIterator[RunningGateway]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    port = sock.getsockname()[1]
    settings.setdefault("database_url", f"sqlite:///{tmp_path / 'gateway.db'}")
    settings.setdefault("public_url", f"http://127.0.0.1:{port}")  # what remote agent servers call back
    try:
        app = create_app(Settings(**settings))
    except BaseException:  # settings refused: do not leak the socket
        sock.close()
        raise
    server = _QuietServer(uvicorn.Config(app, log_level="warning", lifespan="on", http="httptools"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient() as client:  # queued on the listening socket until uvicorn serves
            (await client.get(f"{url}/healthz", timeout=30)).raise_for_status()
        running = RunningGateway(url=url, app=app)
        try:
            yield running
        finally:
            for client in running.clients:
                await client.close()
    finally:
        server.should_exit = True
        await task
        sock.close()


def sse_events(body: str) -> list[tuple[str | None, Any]]:
    """A stream's body as its events: (the ``event:`` name or None, the data parsed; ``[DONE]`` as it is)."""
    out: list[tuple[str | None, Any]] = []
    for block in body.split("\n\n"):
        if not block:
            continue
        name = None
        for line in block.split("\n"):
            key, _, value = line.partition(": ")
            if key == "event":
                name = value
            else:
                assert key == "data"
                out.append((name, value if value == "[DONE]" else json.loads(value)))
    return out


@asynccontextmanager
async def serving(app: Any) -> AsyncIterator[str]:
    """A test's own little server (an ASGI ``app``: a stand-in backend or agent server) on a loopback port, served
    by uvicorn in this event loop: its URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    server = _QuietServer(uvicorn.Config(app, log_level="critical", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()


async def register(store: Store, alias: str, *backends: dict[str, Any], version: str | None = None) -> None:
    await store.put_model(alias, list(backends), version=version)


@asynccontextmanager
async def serving_policy(tmp_path: Path, *backends: dict[str, Any], **settings: Any) -> AsyncIterator[RunningGateway]:
    """A running gateway whose alias ``policy`` (version ``v1``) has ``backends``."""
    async with running_gateway(tmp_path, **settings) as gw:
        await register(gw.store, "policy", *backends, version="v1")
        yield gw


async def claim_one(store: Store) -> tuple[str, str]:
    """Enqueue a task and claim it: (rollout_id, attempt_id)."""
    await store.enqueue([{"input": {"task": "t"}}])
    [claimed] = await store.claim("worker-1")
    return claimed.rollout.rollout_id, claimed.attempt.attempt_id


def closed_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def vllm(mock: MockBackendProcess, backend_id: str = "mock-a", **extra: Any) -> dict[str, Any]:
    """A ``vllm``-kind backend entry for the mock backend process."""
    return {"backend_id": backend_id, "base_url": mock.base_url, "kind": "vllm", "model": "mock-model", **extra}
