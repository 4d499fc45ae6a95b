"""What every request passes before a route sees it (``gateway/guards.py``): a bounded body on the routes outside
the data plane, read no further than the bound even without a token."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from tests.gateway_harness import running_gateway

LIMIT = 4096
TOKEN = "admin-token-for-guards"


def _chunks(size: int) -> AsyncIterator[bytes]:
    async def gen() -> AsyncIterator[bytes]:
        yield b'{"tasks": [{"input": "'
        for _ in range(size // 1024):
            yield b"x" * 1024
        yield b'"}]}'

    return gen()


@pytest.mark.parametrize("path", ["/admin/v1/rollouts", "/v1/agl/rollouts", "/v1/rollout/completed"])
async def test_a_body_over_the_limit_is_a_413_before_the_token_is_checked(tmp_path: Path, path: str) -> None:
    """Declared (``Content-Length``) or not (chunked), with no token, a wrong one or the right one."""
    async with (
        running_gateway(tmp_path, admin_token=TOKEN, max_body_bytes=LIMIT) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {TOKEN}"}):
            headers |= {"Content-Type": "application/json"}
            declared = await http.post(path, content=b'{"x": "' + b"x" * 2 * LIMIT + b'"}', headers=headers)
            assert declared.status_code == 413, (headers, declared.text)
            assert declared.json()["error"]["message"] == f"the request body is larger than {LIMIT} bytes"
            chunked = await http.post(path, content=_chunks(2 * LIMIT), headers=headers)
            assert chunked.status_code == 413, (headers, chunked.text)
            assert chunked.json()["error"]["type"] == "invalid_request_error"
        auth = {"Authorization": f"Bearer {TOKEN}"}
        enqueued = await http.post("/admin/v1/rollouts", json={"tasks": [{"input": 1}]}, headers=auth)
        assert enqueued.status_code == 201, enqueued.text
        assert len((await http.get("/admin/v1/rollouts", headers=auth)).json()["items"]) == 1  # only that one
