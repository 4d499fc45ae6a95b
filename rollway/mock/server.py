"""Running the mock backend: ``serve`` (the CLI), ``run_in_thread`` (in-process) and ``MockBackendProcess``
(``rollway mock-backend`` as a subprocess). The last two give ``base_url`` (``http://host:port/v1``) and small
helpers for the control plane (``add_faults``, ``reset``, ``stats``, ``requests``)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette

from rollway.mock.app import create_mock_app
from rollway.mock.config import Flavor, MockConfig
from rollway.mock.state import MockState
from rollway.process import ServerProcess


class _Server(uvicorn.Server):
    """uvicorn's server that wakes hanging requests at shutdown and can signal when it listens."""

    def __init__(self, config: uvicorn.Config, state: MockState, ready: threading.Event | None = None) -> None:
        super().__init__(config)
        self.mock_state = state
        self.ready = ready

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.ready is not None:
            self.ready.set()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.mock_state.begin_shutdown()
        await super().shutdown(sockets)


def serve(
    config: MockConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 8001,
    log_level: str = "info",
    access_log: bool = False,
) -> None:
    """Serve the mock backend until interrupted (uvloop + httptools, as the gateway)."""
    app = create_mock_app(config)
    uv_config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=access_log,
        loop="uvloop",
        http="httptools",
        lifespan="off",
        timeout_graceful_shutdown=2,
    )
    _Server(uv_config, app.state.mock).run()


class _Control:
    """Helpers over the control plane (``/mock/*``), for tests and benchmarks."""

    url: str

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def add_faults(self, *rules: dict[str, Any]) -> dict[str, Any]:
        response = httpx.post(f"{self.url}/mock/faults", json=list(rules), timeout=10)
        response.raise_for_status()
        result: dict[str, Any] = response.json()
        return result

    def reset(self) -> None:
        httpx.post(f"{self.url}/mock/reset", timeout=10).raise_for_status()

    def stats(self, *, timeout: float = 5.0, **wait: int) -> dict[str, Any]:
        """``GET /mock/stats``; ``wait_cancelled=N`` / ``wait_requests=N`` / ``wait_idle=1`` long-poll first."""
        params: dict[str, Any] = {**wait, "timeout": timeout} if wait else {}
        response = httpx.get(f"{self.url}/mock/stats", params=params, timeout=timeout + 10)
        response.raise_for_status()
        result: dict[str, Any] = response.json()
        return result

    def requests(self, *, path: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"limit": limit} | ({"path": path} if path else {})
        response = httpx.get(f"{self.url}/mock/requests", params=params, timeout=10)
        response.raise_for_status()
        result: list[dict[str, Any]] = response.json()["requests"]
        return result

    def configure(self, **changes: Any) -> dict[str, Any]:
        response = httpx.post(f"{self.url}/mock/config", json=changes, timeout=10)
        response.raise_for_status()
        result: dict[str, Any] = response.json()
        return result


class MockServer(_Control):
    """A mock backend served by ``run_in_thread``."""

    def __init__(self, app: Starlette, host: str, port: int) -> None:
        self.app, self.host, self.port = app, host, port
        self.url = f"http://{host}:{port}"

    @property
    def state(self) -> MockState:
        state: MockState = self.app.state.mock
        return state


@contextmanager
def run_in_thread(
    config: MockConfig | None = None, *, host: str = "127.0.0.1", port: int = 0, startup_timeout: float = 10.0
) -> Iterator[MockServer]:
    """Serve the mock backend from a background thread (its own event loop) on ``host:port`` (0: a free port)."""
    app = create_mock_app(config)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    uv_config = uvicorn.Config(
        app,
        log_config=None,
        log_level="warning",
        access_log=False,
        http="httptools",
        lifespan="off",
        timeout_graceful_shutdown=2,
    )
    ready = threading.Event()
    server = _Server(uv_config, app.state.mock, ready)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as exc:  # reported to the caller below
            failure.append(exc)
        finally:
            ready.set()

    thread = threading.Thread(target=run, name="rollway-mock-backend", daemon=True)
    thread.start()
    try:
        if not ready.wait(startup_timeout) or failure or not server.started:
            raise RuntimeError(f"the mock backend did not start: {failure[0] if failure else 'timeout'}")
        yield MockServer(app, host, sock.getsockname()[1])
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()


class MockBackendProcess(ServerProcess, _Control):
    """``rollway mock-backend`` in a subprocess on a free loopback port; ready once uvicorn says it runs.
    ``flavor`` is the engine it plays (``vllm`` or ``sglang``).

    Use as a context manager (or ``start()`` / ``stop()``); ``output`` holds the server's recent log lines.
    """

    name = "mock backend"

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        latency_ms: float = 0.0,
        ttft_ms: float = 0.0,
        token_delay_ms: float = 0.0,
        models: Sequence[str] = (),
        flavor: Flavor = "vllm",
        extra_args: Sequence[str] = (),
        startup_timeout: float = 30.0,
        env: dict[str, str] | None = None,
    ) -> None:
        args = [
            "mock-backend",
            "--flavor",
            flavor,
            "--host",
            host,
            "--port",
            str(port),
            "--latency-ms",
            str(latency_ms),
            "--ttft-ms",
            str(ttft_ms),
            "--token-delay-ms",
            str(token_delay_ms),
            *(arg for model in models for arg in ("--model", model)),
            *extra_args,
        ]
        ServerProcess.__init__(self, args, env=env, startup_timeout=startup_timeout)
