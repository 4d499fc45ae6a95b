"""A real gateway in the test's event loop (SQLite file) in front of the real mock backend process, for end-to-end
tests with the official ``openai`` SDK: served by uvicorn on a loopback port, or, for tests that neither stream
nor look at the connection, in process (``httpx.ASGITransport``, the app's lifespan run by the test)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from openai import AsyncOpenAI

from rollway.app.factory import RollwayApp, create_app
from rollway.app.state import AppState
from rollway.mock import MockBackendProcess
from rollway.settings import Settings
from rollway.store import Store

#: The address of a gateway served in process: a loopback name (the guards let it through without an admin
#: token) that nothing listens on, so a client that missed the transport fails at once instead of reaching
#: another server.
IN_PROCESS_URL = "http://gateway.localhost"


@dataclass
class RunningGateway:
    """A started gateway: its address, its app and, when it is served in process, the transport that reaches it.
    ``client()`` and ``http()`` reach it either way."""

    url: str
    app: RollwayApp
    transport: httpx.AsyncBaseTransport | None = None
    clients: list[AsyncOpenAI] = field(default_factory=list)

    @property
    def state(self) -> AppState:
        return self.app.state

    @property
    def store(self) -> Store:
        return self.state.store

    def http(self, path: str = "", **kwargs: Any) -> httpx.AsyncClient:
        """An ``httpx`` client whose base URL is the gateway's address followed by ``path``."""
        if self.transport is not None:
            kwargs.setdefault("transport", self.transport)
        return httpx.AsyncClient(base_url=f"{self.url}{path}", **kwargs)

    def client(self, base_url: str | None = None, api_key: str = "unused", **kwargs: Any) -> AsyncOpenAI:
        """An ``openai`` client of the gateway (``base_url`` defaults to its ``/v1``), closed with it."""
        if self.transport is not None and "http_client" not in kwargs:
            kwargs["http_client"] = httpx.AsyncClient(transport=self.transport)
        kwargs.setdefault("max_retries", 0)
        client = AsyncOpenAI(base_url=base_url or f"{self.url}/v1", api_key=api_key, **kwargs)
        self.clients.append(client)
        return client


@dataclass(frozen=True)
class Alias:
    """A model alias the ``gw`` fixture's gateway serves from the start (``Store.put_model``)."""

    name: str
    backends: list[dict[str, Any]]
    version: str | None = "v1"


def build_app(settings: Settings) -> RollwayApp:
    """The app of ``settings``, not started: the one place the harness calls ``create_app``."""
    return create_app(settings)


@asynccontextmanager
async def app_lifespan(settings: Settings) -> AsyncIterator[RollwayApp]:
    """The app of ``settings`` with its lifespan (store, background loops, backend connections) run in this task
    for as long as the block lasts, as a server would run it: the one place tests start an app without one."""
    app = build_app(settings)
    async with app.lifespan():
        yield app


class _QuietServer(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # the test runner owns signals
        return None


@asynccontextmanager
async def running_gateway(
    tmp_path: Path, *, in_process: bool = False, send_buffer: int | None = None, **settings: Any
) -> AsyncIterator[RunningGateway]:
    """A gateway of ``settings`` on a SQLite file in ``tmp_path`` (unless ``database_url`` says otherwise), its
    ``public_url`` its own address; served by uvicorn on a loopback port, or ``in_process``. ``send_buffer`` sets
    the kernel's send buffer of every connection it accepts (they inherit the listening socket's), so that a
    client that stops reading holds the gateway's writes back after that many bytes, not after the megabytes
    loopback's buffers grow to."""
    if in_process:
        async with _in_process(tmp_path, **settings) as running:
            yield running
        return
    sock = listening_socket(send_buffer)
    try:
        port = sock.getsockname()[1]
        settings.setdefault("database_url", f"sqlite:///{tmp_path / 'gateway.db'}")
        settings.setdefault("public_url", f"http://127.0.0.1:{port}")  # what remote agent servers call back
        app = build_app(Settings(**settings))
        server = _QuietServer(uvicorn.Config(app, log_level="warning", lifespan="on", http="httptools"))
        task = asyncio.create_task(_serve(server, sock))
        url = f"http://127.0.0.1:{port}"
        try:
            await _started(task, url)
            running = RunningGateway(url=url, app=app)
            try:
                yield running
            finally:
                for llm in running.clients:
                    await llm.close()
        finally:
            server.should_exit = True
            with contextlib.suppress(GatewayDidNotStart):  # (raised by ``_started`` already)
                await task
    finally:
        sock.close()


def listening_socket(send_buffer: int | None = None) -> socket.socket:
    """A loopback socket on an ephemeral port, listening; ``send_buffer`` as for ``running_gateway``."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if send_buffer is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        sock.bind(("127.0.0.1", 0))
        sock.listen(1024)
    except BaseException:
        sock.close()
        raise
    return sock


class GatewayDidNotStart(RuntimeError):
    """The gateway's application did not start (its lifespan failed: uvicorn logged why)."""


async def _serve(server: uvicorn.Server, sock: socket.socket) -> None:
    """``server`` on ``sock`` until it stops. uvicorn ends a server whose application fails to start with
    ``sys.exit``, which would leave the event loop itself: it is raised here as ``GatewayDidNotStart``."""
    try:
        await server.serve(sockets=[sock])
    except SystemExit as exc:
        raise GatewayDidNotStart(f"the gateway did not start (uvicorn's exit status {exc.code})") from None


async def _started(task: asyncio.Task[None], url: str) -> None:
    """Once the server of ``task`` answers ``/healthz`` (the request waits on the listening socket until uvicorn
    serves); ``GatewayDidNotStart`` if the server ends first."""
    async with httpx.AsyncClient() as client:
        healthz = asyncio.ensure_future(client.get(f"{url}/healthz", timeout=30))
        try:
            await asyncio.wait({healthz, task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            healthz.cancel()
        if task.done():
            task.result()  # the server's error
            raise GatewayDidNotStart("the gateway stopped before it answered /healthz")
        healthz.result().raise_for_status()


@asynccontextmanager
async def _in_process(tmp_path: Path, **settings: Any) -> AsyncIterator[RunningGateway]:
    settings.setdefault("database_url", f"sqlite:///{tmp_path / 'gateway.db'}")
    settings.setdefault("public_url", IN_PROCESS_URL)
    async with app_lifespan(Settings(**settings)) as app:
        running = RunningGateway(url=IN_PROCESS_URL, app=app, transport=httpx.ASGITransport(app=app))
        try:
            yield running
        finally:
            for client in running.clients:
                await client.close()


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
    """A running gateway whose alias ``policy`` (version ``v1``) has ``backends`` (``settings`` as for
    ``running_gateway``)."""
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


async def replay(mock: MockBackendProcess, request: dict[str, Any]) -> dict[str, Any]:
    """What the backend answers, with token ids, to a call's request sent to it directly."""
    body = {**request, "model": "mock-model", "return_token_ids": True, "logprobs": True, "top_logprobs": 0}
    async with httpx.AsyncClient(timeout=30) as client:
        answer = await client.post(f"{mock.base_url}/chat/completions", json=body)
    answer.raise_for_status()
    result: dict[str, Any] = answer.json()
    return result
