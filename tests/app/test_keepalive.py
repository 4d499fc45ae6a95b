"""Keep-alive: an agent that pauses between calls (a tool that runs for seconds) keeps its pooled connection
(``ROLLWAY_KEEPALIVE_TIMEOUT``, 75 s by default, where uvicorn's own is 5 s), and an error answer does not close it.
Against a real ``rollway serve`` with the official ``openai`` SDK, retries off, so a dropped connection shows."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam

from rollway.mock import MockBackendProcess
from rollway.process import GatewayProcess
from rollway.settings import Settings

TOKEN = "admin-secret-token"
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
PAUSE = 10.0


def test_the_keepalive_timeout_is_a_setting_that_outlives_agent_pauses() -> None:
    assert Settings().keepalive_timeout == 75
    assert Settings(keepalive_timeout=120).keepalive_timeout == 120


async def test_an_agent_pausing_between_calls_keeps_its_connection(tmp_path: Any, mock: MockBackendProcess) -> None:
    gateway = GatewayProcess(f"sqlite:///{tmp_path / 'gateway.db'}", admin_token=TOKEN)
    await asyncio.to_thread(gateway.start)
    try:
        backend = {"backend_id": "mock", "base_url": mock.base_url, "kind": "vllm", "model": "mock-model"}
        async with httpx.AsyncClient(base_url=gateway.url) as admin:
            put = await admin.put("/admin/v1/models/policy", json={"backends": [backend]}, headers=_auth())
            assert put.status_code in (200, 201), put.text
        ports: list[int] = []

        async def remember(response: httpx.Response) -> None:  # the client's end of the connection it came on
            ports.append(response.extensions["network_stream"].get_extra_info("client_addr")[1])

        # (httpx drops an idle connection after 5 s by default: kept here, so that only the server can drop it)
        limits = httpx.Limits(max_connections=1, keepalive_expiry=60)
        http = httpx.AsyncClient(event_hooks={"response": [remember]}, limits=limits)
        # An httpx client: the SDK takes one as well as an httpx2 one, though its annotation names only httpx2's.
        client = AsyncOpenAI(
            base_url=f"{gateway.url}/v1",
            api_key="unused",
            max_retries=0,
            http_client=http,  # type: ignore[arg-type]
        )
        async with client:
            first = await client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=4)
            with pytest.raises(openai.NotFoundError):  # an error answer (404 in the envelope) ...
                await client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=4)
            await asyncio.sleep(PAUSE)  # ... then the agent's tool runs for a while
            second = await client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=4)
        assert first.choices[0].message.content and second.choices[0].message.content
        assert len(ports) == 3 and len(set(ports)) == 1, ports  # one connection for all three
    finally:
        await asyncio.to_thread(gateway.stop)


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}
