"""Shared by the scripts that run inside the Agent-lightning 0.3.0 environment (not Rollway's)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.asynccontextmanager
async def agl_server() -> AsyncIterator[str]:
    """Agent-lightning's own store server over its in-memory store, in this process (a thread)."""
    from agentlightning.store.client_server import LightningStoreServer
    from agentlightning.store.memory import InMemoryLightningStore

    server = LightningStoreServer(
        InMemoryLightningStore(thread_safe=True), host="127.0.0.1", port=free_port(), launch_mode="thread"
    )
    await server.start()
    try:
        yield server.endpoint
    finally:
        await server.stop()


def dump(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if isinstance(value, list | tuple):
        return [dump(v) for v in value]
    if isinstance(value, dict):
        return {k: dump(v) for k, v in value.items()}
    return value
