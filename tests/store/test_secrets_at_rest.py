"""API keys kept for others at rest: with a secret key (``ROLLWAY_SECRET_KEY``, a Fernet key) a backend's and an
agent server's ``api_key`` are stored encrypted, keys stored in clear before are encrypted when the store opens,
and a database whose keys the process cannot decrypt is refused at start, in a sentence."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, closing
from pathlib import Path

import asyncpg
import httpx
import pytest
from cryptography.fernet import Fernet
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rollway.settings import Settings, error_summary
from rollway.store import Store, StoreValidationError
from rollway.store.schemas import AgentServer
from support.gateway_harness import running_gateway, serving

BACKEND_KEY = "sk-at-rest-backend-5e81c2"
AGENT_KEY = "agent-at-rest-7d03b9e4"
SECRET = Fernet.generate_key().decode()
MESSAGE = {"role": "assistant", "content": "hi"}
ANSWER = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
          "choices": [{"index": 0, "message": MESSAGE, "finish_reason": "stop"}]}  # fmt: skip


async def stored_rows(url: str) -> str:
    """Everything the database holds, as text: SQLite's dump of the file, PostgreSQL's tables read with asyncpg."""
    if url.startswith("sqlite:///"):
        with closing(sqlite3.connect(url.removeprefix("sqlite:///"))) as db:
            return "\n".join(db.iterdump())
    conn = await asyncpg.connect(url)
    try:
        tables = [await conn.fetch(f"SELECT * FROM {table}") for table in ("model_aliases", "agent_servers")]
        return repr([[tuple(row) for row in rows] for rows in tables])
    finally:
        await conn.close()


@asynccontextmanager
async def backend() -> AsyncIterator[tuple[str, list[str]]]:
    """A backend answering every chat completion: its URL and the ``Authorization`` headers it got."""
    seen: list[str] = []

    async def complete(request: Request) -> Response:
        seen.append(request.headers.get("authorization", ""))
        return JSONResponse(ANSWER)

    async with serving(Starlette(routes=[Route("/v1/chat/completions", complete, methods=["POST"])])) as url:
        yield f"{url}/v1", seen


async def put_keyed(store: Store, url: str = "http://127.0.0.1:9/v1") -> None:
    await store.put_model("policy", [{"backend_id": "b", "base_url": url, "kind": "openai", "model": "m",
                                      "api_key": BACKEND_KEY}])  # fmt: skip
    await store.put_agent(AgentServer(name="agent", url="http://127.0.0.1:9", api_key=AGENT_KEY))


async def keys_read(store: Store) -> tuple[str | None, str | None]:
    backend_key = (await store.get_model("policy")).backends[0].api_key
    agent_key = (await store.get_agent("agent")).api_key
    return (
        backend_key.get_secret_value() if backend_key else None,
        agent_key.get_secret_value() if agent_key else None,
    )


async def test_keys_are_stored_encrypted_and_still_sent(tmp_path: Path, store_url: str) -> None:
    async with backend() as (url, seen), running_gateway(tmp_path, database_url=store_url, secret_key=SECRET) as gw:
        await put_keyed(gw.store, url)
        rows = await stored_rows(store_url)
        assert "api_key_sealed" in rows and BACKEND_KEY not in rows and AGENT_KEY not in rows
        async with httpx.AsyncClient(timeout=10) as http:
            body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
            response = await http.post(f"{gw.url}/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        assert seen == [f"Bearer {BACKEND_KEY}"]
        assert await keys_read(gw.store) == (BACKEND_KEY, AGENT_KEY)


async def test_keys_stored_in_clear_are_encrypted_when_a_store_opens_with_a_secret_key(store_url: str) -> None:
    async with await Store.open(store_url, run_watchdog=False) as store:
        await put_keyed(store)
    assert BACKEND_KEY in await stored_rows(store_url) and AGENT_KEY in await stored_rows(store_url)
    async with await Store.open(store_url, run_watchdog=False, secret_key=SECRET) as store:
        rows = await stored_rows(store_url)
        assert BACKEND_KEY not in rows and AGENT_KEY not in rows
        assert await keys_read(store) == (BACKEND_KEY, AGENT_KEY)


async def test_encrypted_keys_are_refused_without_the_key_that_encrypted_them(store_url: str) -> None:
    """No secret key, or another one: the store does not open, and says why; the old key after a new one
    (``new,old``) opens it and encrypts the keys again with the new one, which alone opens it from then on."""
    async with await Store.open(store_url, run_watchdog=False, secret_key=SECRET) as store:
        await put_keyed(store)
    with pytest.raises(StoreValidationError, match=r"encrypted API key.*no secret key is set"):
        await Store.open(store_url, run_watchdog=False)
    other = Fernet.generate_key().decode()
    with pytest.raises(StoreValidationError, match="does not decrypt the api_key of"):
        await Store.open(store_url, run_watchdog=False, secret_key=other)
    async with await Store.open(store_url, run_watchdog=False, secret_key=f"{other},{SECRET}") as store:
        assert await keys_read(store) == (BACKEND_KEY, AGENT_KEY)
    async with await Store.open(store_url, run_watchdog=False, secret_key=other) as store:
        assert await keys_read(store) == (BACKEND_KEY, AGENT_KEY)


def test_a_secret_key_that_is_not_a_fernet_key_is_refused_without_showing_it() -> None:
    with pytest.raises(ValidationError) as refused:
        Settings(secret_key="hunter2-not-a-fernet-key")
    assert "not a Fernet key" in error_summary(refused.value) and "hunter2" not in error_summary(refused.value)
