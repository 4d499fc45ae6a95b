"""Several backends behind one alias, end to end: the official openai SDK (or httpx) → a real gateway → the mock
backend. Each backend of the alias names a model of its own on the one mock process, so that a fault can target
one backend. Covered: the version of the backend that served a call in its span and in the exports."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx

from gateway.mock import MockBackendProcess
from tests.gateway_harness import RunningGateway, claim_one, register, running_gateway, vllm

MESSAGES = [{"role": "user", "content": "What is 17 + 25?"}]


@asynccontextmanager
async def gateway(tmp_path: Path, *backends: dict[str, Any], **settings: Any) -> AsyncIterator[RunningGateway]:
    async with running_gateway(tmp_path, **settings) as gw:
        await register(gw.store, "policy", *backends, version="v1")
        yield gw


def backend(mock: MockBackendProcess, name: str, **extra: Any) -> dict[str, Any]:
    """Backend ``name`` of the alias: the mock, asked for model ``model-<name>`` (what a fault can match)."""
    return vllm(mock, name, model=f"model-{name}", **extra)


# -- the version of the backend that served the call ------------------------------------------------------


async def test_a_span_records_the_version_of_the_backend_that_served_it(
    tmp_path: Path, mock: MockBackendProcess
) -> None:
    """A backend with a version of its own: its calls' spans (and the triplets exported from them) carry that
    version; a backend without one serves under the alias's version."""
    async with gateway(tmp_path, backend(mock, "a", version="ckpt-7")) as gw:
        rollout_id, _ = await claim_one(gw.store)
        client = gw.client(f"{gw.url}/rollout/{rollout_id}/v1")
        await client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=4)
        await gw.store.put_model("policy", [backend(mock, "b")], version="v2")
        gw.state.registry.invalidate("policy")
        later = [*MESSAGES, {"role": "assistant", "content": "42"}, {"role": "user", "content": "And 18 + 25?"}]
        await client.chat.completions.create(model="policy", messages=later, max_tokens=4)
        assert await gw.state.registry.drain("policy", 10)
        spans = await gw.store.query_spans(rollout_id)
        assert [(s.attributes["rollway.backend_id"], s.attributes["rollway.model_version"]) for s in spans] == [
            ("a", "ckpt-7"),
            ("b", "v2"),
        ]
        async with httpx.AsyncClient(base_url=f"{gw.url}/admin/v1", timeout=30) as admin:
            ended = await admin.patch(f"/rollouts/{rollout_id}/attempts/latest", json={"status": "succeeded"})
            assert ended.status_code == 200, ended.text
            triplets = (await admin.get("/triplets", params={"rollout_id": rollout_id})).json()["items"]
        assert [t["model_version"] for t in triplets] == ["ckpt-7", "v2"]
