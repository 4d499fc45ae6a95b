"""Backends put without a kind (``auto``): the gateway asks the server what engine it is, vLLM's token ids are
recorded without anyone saying ``--kind vllm``, and a server that gives no token ids is never a silent loss of
training data (a log line per alias, a metric, and a field of ``GET /admin/v1/models``)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncStream
from openai.types.chat import ChatCompletionMessageParam
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from rollway.gateway.kinds import BackendKinds, server_root
from rollway.mock import MockBackendProcess
from rollway.store import Backend
from support.gateway_harness import RunningGateway, claim_one, closed_port, running_gateway, serving

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is 2 + 2?"}]


@asynccontextmanager
async def plain_server(received: list[dict[str, Any]]) -> AsyncIterator[str]:
    """An OpenAI-compatible server that is no engine Rollway knows: it answers chat completions without token ids
    and has neither ``/version`` nor SGLang's routes. The bodies it gets go to ``received``."""

    async def chat(request: Request) -> JSONResponse:
        received.append(await request.json())
        message = {"role": "assistant", "content": "4"}
        return JSONResponse(
            {
                "id": "chatcmpl-plain",
                "object": "chat.completion",
                "created": 1,
                "model": "plain-model",
                "choices": [{"index": 0, "message": message, "finish_reason": "stop", "logprobs": None}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
            }
        )

    async with serving(Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])) as url:
        yield f"{url}/v1"


async def put_without_kind(gw: RunningGateway, alias: str, base_url: str, model: str) -> dict[str, Any]:
    backend = {"backend_id": f"{alias}-b", "base_url": base_url, "model": model}
    async with httpx.AsyncClient(base_url=gw.url) as admin:
        response = await admin.put(f"/admin/v1/models/{alias}", json={"backends": [backend]})
    assert response.status_code == 200, response.text
    view: dict[str, Any] = response.json()
    return view


async def model_view(gw: RunningGateway, alias: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=gw.url) as admin:
        response = await admin.get("/admin/v1/models")
    [view] = [m for m in response.json()["items"] if m["alias"] == alias]
    return dict(view)


async def test_an_alias_put_without_a_kind_in_front_of_the_mock_records_trainable_spans(
    tmp_path: Path, mock: MockBackendProcess
) -> None:
    async with running_gateway(tmp_path) as gw:
        put = await put_without_kind(gw, "policy", mock.base_url, "mock-model")
        assert [(b["kind"], b["detected_kind"]) for b in put["backends"]] == [("auto", "vllm")]
        rollout_id, attempt_id = await claim_one(gw.store)
        client = gw.client(f"{gw.url}/rollout/{rollout_id}/attempt/{attempt_id}/v1")
        for stream in (False, True):
            answer = await client.chat.completions.create(model="policy", messages=MESSAGES, stream=stream)
            if stream:
                assert isinstance(answer, AsyncStream)
                assert [chunk async for chunk in answer]
        spans = await gw.store.query_spans(rollout_id, attempt_id)
        view = await model_view(gw, "policy")
    assert [s.attributes["rollway.trainable"] for s in spans] == [True, True]
    assert all(s.attributes["gen_ai.system"] == "vllm" for s in spans)
    assert view["capture"] == {"completions": 2, "untrainable": 0, "without_logprobs": 0}


async def test_an_echo_is_not_counted_as_a_lost_training_sample(tmp_path: Path, mock: MockBackendProcess) -> None:
    """A text completion's ``echo`` comes without token ids by design (vLLM drops the prompt's text when they are
    asked): its span is not trainable, and it is not counted as a completion that should have been."""
    async with running_gateway(tmp_path) as gw:
        await put_without_kind(gw, "policy", mock.base_url, "mock-model")
        client = gw.client()
        await client.completions.create(model="policy", prompt="Once upon a time", max_tokens=3, echo=True)
        await client.completions.create(model="policy", prompt="Once upon a time", max_tokens=3)
        view = await model_view(gw, "policy")
    assert view["capture"] == {"completions": 1, "untrainable": 0, "without_logprobs": 0}


async def test_a_server_without_token_ids_is_shown_as_such_and_its_calls_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    received: list[dict[str, Any]] = []
    caplog.set_level(logging.WARNING, logger="rollway.gateway")
    async with plain_server(received) as url, running_gateway(tmp_path) as gw:
        put = await put_without_kind(gw, "plain", url, "plain-model")
        assert [(b["kind"], b["detected_kind"]) for b in put["backends"]] == [("auto", "openai")]
        client = gw.client()
        for _ in range(3):
            answer = await client.chat.completions.create(model="plain", messages=MESSAGES)
            assert answer.choices[0].message.content == "4"
        view = await model_view(gw, "plain")
        async with httpx.AsyncClient() as http:
            metrics = (await http.get(f"{gw.url}/metrics")).text
    assert view["capture"] == {"completions": 3, "untrainable": 3, "without_logprobs": 0}
    assert not any("return_token_ids" in body or "logprobs" in body for body in received)  # asked as OpenAI
    series = [line for line in metrics.splitlines() if line.startswith("rollway_untrainable_calls_total{")]
    assert series == [
        'rollway_untrainable_calls_total{alias="plain",backend="plain-b",route="/v1/chat/completions"} 3.0'
    ]
    warnings = [r.getMessage() for r in caplog.records if "without token ids" in r.getMessage()]
    assert len(warnings) == 1 and "'plain'" in warnings[0] and "kind openai" in warnings[0]


async def test_a_backend_that_cannot_be_reached_is_asked_again_later(mock: MockBackendProcess) -> None:
    """Not reachable: served as ``openai`` for now, nothing remembered; the same backend, reachable, is ``vllm``,
    remembered until a try on it fails."""
    kinds = BackendKinds(timeout=2.0)
    try:
        down = Backend(backend_id="b", base_url=f"http://127.0.0.1:{closed_port()}/v1", model="m")
        assert (await kinds.resolve(down)).kind == "openai"
        assert kinds.detected() == {}
        up = Backend(backend_id="b", base_url=mock.base_url, model="mock-model")
        resolved = await kinds.resolve(up)
        assert resolved.kind == "vllm" and kinds.detected() == {"b": "vllm"}
        # Only the kind is kept: the same backend put again with new weights and a new key is served as it is now.
        swapped = up.model_copy(update={"model": "step-200", "version": "200", "api_key": "sk-new-key-0001"})
        now = await kinds.resolve(swapped)
        assert (now.kind, now.model, now.version, now.api_key) == ("vllm", "step-200", "200", swapped.api_key)
        kinds.forget(up)
        assert kinds.detected() == {}
    finally:
        await kinds.close()


async def test_a_server_answering_errors_is_not_taken_for_openai_for_good() -> None:
    """A 503 on every route (a server starting behind an ingress) tells nothing: served as openai for a while,
    not remembered as such, and not asked again on every call meanwhile."""
    asked: list[str] = []

    async def starting(request: Request) -> JSONResponse:
        asked.append(request.url.path)
        return JSONResponse({"error": "not ready"}, status_code=503)

    routes = [Route(f"/{name}", starting) for name in ("get_model_info", "model_info", "version")]
    kinds = BackendKinds(timeout=2.0)
    try:
        async with serving(Starlette(routes=routes)) as url:
            backend = Backend(backend_id="starting", base_url=f"{url}/v1", model="m")
            assert (await kinds.resolve(backend)).kind == "openai"
            assert (await kinds.resolve(backend)).kind == "openai"
        assert kinds.detected() == {}
        assert asked == ["/get_model_info", "/model_info", "/version"]  # once, not per call
    finally:
        await kinds.close()


def test_the_server_root_is_the_base_url_without_v1() -> None:
    assert server_root("http://h:8000/v1") == "http://h:8000"
    assert server_root("http://h:8000/v1/") == "http://h:8000"
    assert server_root("http://h/proxy/v1") == "http://h/proxy"
    assert server_root("http://h:8000") == "http://h:8000"
