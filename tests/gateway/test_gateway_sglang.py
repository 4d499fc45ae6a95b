"""End to end against SGLang: a client (raw HTTP, and the official openai SDK) → a real gateway (uvicorn, SQLite) →
the mock backend process playing SGLang 0.5.23 (``rollway mock-backend --flavor sglang``), compared with the same
request sent to the mock directly. The alias is put without a kind (the gateway asks ``/get_model_info`` and finds
SGLang) and with ``kind: sglang``.

The client must get what a direct call answers -- none of the token ids, ``sglext`` chunks, logprobs or usage the
gateway asked for on its behalf -- and the span must hold what SGLang said: the prompt's and the response's token
ids (a whole answer's ``prompt_token_ids`` and ``response_token_ids``, a streamed chat's ``sglext`` ids), and the
logprobs when there is one per token (a streamed chat leaves out those of tokens that add no text: then none)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from rollway.mock import MockBackendProcess
from support.gateway_harness import RunningGateway, claim_one

#: What differs between two calls of the same request.
VOLATILE = {"id", "created"}
#: Answered with a sentence and the end-of-sequence token (its streamed logprob is lost); ``CUT`` stops it first.
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
CUT = {"max_tokens": 4}
PROMPT = "Once upon a time"
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
#: What the gateway asks of SGLang for the span, and must not show a client that did not ask for it.
CAPTURED_KEYS = {"prompt_token_ids", "response_token_ids", "token_ids", "sglext"}


@pytest.fixture(params=[None, "sglang"], ids=["detected", "kind-sglang"])
async def gw(request: pytest.FixtureRequest, gw: RunningGateway, sglang_mock: MockBackendProcess) -> RunningGateway:
    """The shared gateway, its alias ``policy`` put through the admin API: the kind detected, or said."""
    backend: dict[str, Any] = {"backend_id": "sgl", "base_url": sglang_mock.base_url, "model": "mock-model"}
    if request.param is not None:
        backend["kind"] = request.param
    async with gw.http() as admin:
        put = await admin.put("/admin/v1/models/policy", json={"backends": [backend]})
    assert put.status_code == 200, put.text
    [view] = put.json()["backends"]
    assert (view["kind"], view["detected_kind"]) == (request.param or "auto", "sglang")
    return gw


async def attempt_url(gw: RunningGateway) -> tuple[str, str, str]:
    rollout_id, attempt_id = await claim_one(gw.store)
    return f"{gw.url}/rollout/{rollout_id}/attempt/{attempt_id}/v1", rollout_id, attempt_id


async def call(base_url: str, path: str, model: str, **body: Any) -> Any:
    """The raw answer: a JSON body, or a stream's events (``data`` parsed, with its ``event:`` name when it has
    one), with ``id`` and ``created`` left out."""
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.post(f"{base_url}{path}", json={"model": model, **body})
        assert response.status_code == 200, response.text
    if not body.get("stream"):
        return _stable(response.json())
    out: list[Any] = []
    for block in response.text.split("\n\n"):
        if block:
            lines = dict(line.split(": ", 1) for line in block.split("\n"))
            data = lines["data"] if lines["data"] == "[DONE]" else _stable(json.loads(lines["data"]))
            out.append((lines["event"], data) if "event" in lines else data)
    return out


def _stable(data: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if k not in VOLATILE}


async def both(gw: RunningGateway, mock: MockBackendProcess, path: str, **body: Any) -> tuple[Any, Any, str, str]:
    """The same request through the gateway (as a rollout's call) and directly: (via, direct, rollout, attempt)."""
    url, rollout_id, attempt_id = await attempt_url(gw)
    via = await call(url, path, "policy", **body)
    direct = await call(mock.base_url, path, "mock-model", **body)
    return via, direct, rollout_id, attempt_id


def keys_seen(answer: Any) -> set[str]:
    """Every key anywhere in an answer (a body or a stream's chunks)."""
    if isinstance(answer, dict):
        return set(answer) | {k for v in answer.values() for k in keys_seen(v)}
    if isinstance(answer, list | tuple):
        return {k for v in answer for k in keys_seen(v)}
    return set()


async def span_of(gw: RunningGateway, rollout_id: str, attempt_id: str) -> dict[str, Any]:
    [span] = await gw.store.query_spans(rollout_id, attempt_id)
    assert span.status.status_code == "OK"
    assert span.attributes["rollway.trainable"] is True and span.attributes["gen_ai.system"] == "sglang"
    return dict(span.attributes)


def logprob_values(choice: dict[str, Any]) -> list[float]:
    return [entry["logprob"] for entry in choice["logprobs"]["content"]]


# ---------------------------------------------------------------------------------------------------- chat


@pytest.mark.parametrize("asked", [{}, {"logprobs": True, "top_logprobs": 2}, {"n": 2}], ids=["plain", "top", "n2"])
async def test_a_whole_chat_answers_as_sglang_and_records_its_token_ids(
    gw: RunningGateway, sglang_mock: MockBackendProcess, asked: dict[str, Any]
) -> None:
    via, direct, rollout_id, attempt_id = await both(gw, sglang_mock, "/chat/completions", messages=MESSAGES, **asked)
    assert via == direct
    assert [list(c) for c in via["choices"]] == [list(c) for c in direct["choices"]]  # absent stays absent
    assert not keys_seen(via) & CAPTURED_KEYS
    truth = await call(
        sglang_mock.base_url,
        "/chat/completions",
        "mock-model",
        messages=MESSAGES,
        return_token_ids=True,
        **{"logprobs": True, **asked},
    )
    attrs = await span_of(gw, rollout_id, attempt_id)
    first = truth["choices"][0]
    assert attrs["rollway.prompt_token_ids"] == first["prompt_token_ids"]
    assert attrs["rollway.response_token_ids"] == first["response_token_ids"]
    assert attrs["rollway.response_logprobs"] == logprob_values(first)
    if asked.get("n") == 2:
        recorded = attrs["rollway.choices"]
        assert [c["token_ids"] for c in recorded] == [c["response_token_ids"] for c in truth["choices"]]
        assert [c["logprobs"] for c in recorded] == [logprob_values(c) for c in truth["choices"]]


@pytest.mark.parametrize("asked", [{}, {"logprobs": True, "top_logprobs": 2}, {"n": 2}], ids=["plain", "top", "n2"])
@pytest.mark.parametrize("cut", [False, True], ids=["eos", "cut"])
async def test_a_streamed_chat_answers_as_sglang_and_records_the_sglext_ids(
    gw: RunningGateway, sglang_mock: MockBackendProcess, asked: dict[str, Any], cut: bool
) -> None:
    """The ids come from the ``sglext`` chunk the gateway asked for (and keeps from the client); the logprobs are
    the stream's when it sent one per token (a cut answer), else the engine's scores of the output: an answer
    that ends with the end-of-sequence token (which adds no text) has one fewer (``gateway.scoring``)."""
    ask: dict[str, Any] = {"messages": MESSAGES, "stream": True, **asked, **(CUT if cut else {})}
    via, direct, rollout_id, attempt_id = await both(gw, sglang_mock, "/chat/completions", **ask)
    assert via == direct
    assert not keys_seen(via) & CAPTURED_KEYS and not any(isinstance(c, dict) and "usage" in c for c in via)
    streamed = await call(
        sglang_mock.base_url,
        "/chat/completions",
        "mock-model",
        return_input_ids_in_sglext=True,
        return_output_ids_in_sglext=True,
        **ask,
    )
    ids = streamed[-2]["sglext"]
    whole = await call(
        sglang_mock.base_url,
        "/chat/completions",
        "mock-model",
        **{"logprobs": True, **{k: v for k, v in ask.items() if k != "stream"}},
    )
    attrs = await span_of(gw, rollout_id, attempt_id)
    assert attrs["rollway.prompt_token_ids"] == ids["input_ids"]
    assert attrs["rollway.response_token_ids"] == ids["output_ids"][0]
    assert attrs["rollway.response_logprobs"] == logprob_values(whole["choices"][0])
    assert attrs["rollway.logprobs_source"] == ("sampled" if cut else "scored")
    if asked.get("n") == 2:
        assert [c["token_ids"] for c in attrs["rollway.choices"]] == ids["output_ids"]


async def test_a_streamed_chat_to_an_sglang_with_a_tool_call_parser_answers_as_sglang(
    gw: RunningGateway, sglang_mock: MockBackendProcess
) -> None:
    """A server started with ``--tool-call-parser`` (as agents' usually are) sends the logprobs of a step that adds
    no text in a chunk of their own, whose delta says nothing, when logprobs were asked: a client that did not ask
    for them must not get those chunks. The span's logprobs are then whole."""
    sglang_mock.configure(tool_call_parser="qwen25")
    via, direct, rollout_id, attempt_id = await both(
        gw, sglang_mock, "/chat/completions", messages=MESSAGES, stream=True
    )
    assert via == direct
    whole = await call(sglang_mock.base_url, "/chat/completions", "mock-model", messages=MESSAGES, logprobs=True)
    attrs = await span_of(gw, rollout_id, attempt_id)
    assert attrs["rollway.response_logprobs"] == logprob_values(whole["choices"][0])


async def test_a_client_that_asks_for_the_token_ids_gets_them_as_from_sglang(
    gw: RunningGateway, sglang_mock: MockBackendProcess
) -> None:
    via, direct, rollout_id, attempt_id = await both(
        gw, sglang_mock, "/chat/completions", messages=MESSAGES, return_token_ids=True
    )
    assert via == direct and list(via["choices"][0])[-2:] == ["prompt_token_ids", "response_token_ids"]
    attrs = await span_of(gw, rollout_id, attempt_id)
    assert attrs["rollway.response_token_ids"] == via["choices"][0]["response_token_ids"]


async def test_a_client_that_asks_for_the_output_ids_of_a_stream_gets_them_and_a_trainable_span(
    gw: RunningGateway, sglang_mock: MockBackendProcess
) -> None:
    """The client's ``return_output_ids_in_sglext``: its ids chunk as from SGLang (without the prompt's ids it did
    not ask for), and the span still has both."""
    ask = {"messages": MESSAGES, "stream": True, "return_output_ids_in_sglext": True}
    via, direct, rollout_id, attempt_id = await both(gw, sglang_mock, "/chat/completions", **ask)
    assert via == direct and list(via[-2]["sglext"]) == ["output_ids"]
    attrs = await span_of(gw, rollout_id, attempt_id)
    assert attrs["rollway.response_token_ids"] == via[-2]["sglext"]["output_ids"][0]
    assert attrs["rollway.prompt_token_ids"] is not None


async def test_sglangs_refusal_of_token_ids_on_a_stream_reaches_the_client(gw: RunningGateway) -> None:
    url, _, _ = await attempt_url(gw)
    body = {"model": "policy", "messages": MESSAGES, "stream": True, "return_token_ids": True}
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.post(f"{url}/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json()["type"] == "BadRequest" and "not supported with streaming" in response.json()["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_the_openai_sdk_reads_the_same_answer_through_the_gateway(
    gw: RunningGateway, sglang_mock: MockBackendProcess, stream: bool
) -> None:
    """SGLang's extra fields (``matched_stop``, ``metadata``, ``reasoning_content``) reach the SDK as a direct
    call's do, and none of the ones the gateway asked for. (The SDK's ``ChatCompletion.metadata`` is a map of
    strings: SGLang's list of weight versions makes ``model_dump`` warn, either way.)"""
    url, _, _ = await attempt_url(gw)
    ask: dict[str, Any] = {"messages": MESSAGES, "n": 2, "logprobs": True, "top_logprobs": 2}
    async with AsyncOpenAI(base_url=sglang_mock.base_url, api_key="unused", max_retries=0) as direct:
        answers = []
        for client, model in ((gw.client(url), "policy"), (direct, "mock-model")):
            if stream:
                chunks = await client.chat.completions.create(model=model, stream=True, **ask)
                answers.append([_stable(c.model_dump(warnings=False)) async for c in chunks])
            else:
                answer = await client.chat.completions.create(model=model, **ask)
                answers.append([_stable(answer.model_dump(warnings=False))])
    via, expected = answers
    assert via == expected
    assert not keys_seen(via) & CAPTURED_KEYS
    assert all("matched_stop" in c for answer in via for c in answer["choices"])


# ---------------------------------------------------------------------------------------------- tool calls


@pytest.mark.parametrize("parser", ["", "qwen25"], ids=["no-parser", "parser"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("logprobs", [False, True], ids=["-", "logprobs"])
async def test_a_tool_call_answers_as_sglang(
    gw: RunningGateway, sglang_mock: MockBackendProcess, parser: str, stream: bool, logprobs: bool
) -> None:
    """Without a tool-call parser SGLang answers the call's markup as text; with one, as tool calls, and a streamed
    step's logprobs then come in a chunk of their own (with an empty delta) -- only when logprobs were asked."""
    sglang_mock.configure(tool_call_parser=parser)
    ask: dict[str, Any] = {"messages": MESSAGES, "tools": [CALCULATOR], "stream": stream}
    if logprobs:
        ask |= {"logprobs": True, "top_logprobs": 1}
    via, direct, rollout_id, attempt_id = await both(gw, sglang_mock, "/chat/completions", **ask)
    assert via == direct
    assert not keys_seen(via) & CAPTURED_KEYS
    truth = await call(
        sglang_mock.base_url,
        "/chat/completions",
        "mock-model",
        messages=MESSAGES,
        tools=[CALCULATOR],
        return_token_ids=True,
        logprobs=True,
    )
    first = truth["choices"][0]
    attrs = await span_of(gw, rollout_id, attempt_id)
    assert attrs["rollway.response_token_ids"] == first["response_token_ids"]
    recorded = attrs["rollway.response"]["choices"][0]["message"]
    if parser:
        assert recorded["tool_calls"][0]["function"] == first["message"]["tool_calls"][0]["function"]
        assert attrs["rollway.response_logprobs"] == logprob_values(first)  # every step's, the parser's way
    else:
        assert recorded["content"] == first["message"]["content"]


# --------------------------------------------------------------------------------------------- completions


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("asked", [{}, {"logprobs": 2}, {"n": 2}], ids=["plain", "top", "n2"])
async def test_a_completion_answers_as_sglang_and_records_its_token_ids(
    gw: RunningGateway, sglang_mock: MockBackendProcess, stream: bool, asked: dict[str, Any]
) -> None:
    """Completions carry their ids per choice, streamed or not, and every token sends a chunk: the logprobs are
    whole either way. Chunks keep SGLang's ``"usage": null``."""
    ask: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 30, "stream": stream, **asked}
    via, direct, rollout_id, attempt_id = await both(gw, sglang_mock, "/completions", **ask)
    assert via == direct
    assert not keys_seen(via) & CAPTURED_KEYS
    if stream:
        assert all(c["usage"] is None for c in via[:-1])
    truth = await call(
        sglang_mock.base_url,
        "/completions",
        "mock-model",
        prompt=PROMPT,
        max_tokens=30,
        return_token_ids=True,
        **{"logprobs": 0, **asked},
    )
    first = truth["choices"][0]
    attrs = await span_of(gw, rollout_id, attempt_id)
    assert attrs["rollway.prompt_token_ids"] == first["prompt_token_ids"]
    assert attrs["rollway.response_token_ids"] == first["token_ids"]
    assert attrs["rollway.response_logprobs"] == first["logprobs"]["token_logprobs"]
    if asked.get("n") == 2:
        assert [c["token_ids"] for c in attrs["rollway.choices"]] == [c["token_ids"] for c in truth["choices"]]


# ------------------------------------------------------------------------------------------- responses API


async def test_the_responses_api_passes_through_untrainable(
    gw: RunningGateway, sglang_mock: MockBackendProcess
) -> None:
    via, direct, rollout_id, attempt_id = await both(gw, sglang_mock, "/responses", input=PROMPT, max_output_tokens=8)
    apart = {"output", "created_at"}  # two calls: their seconds may differ
    assert {k: v for k, v in via.items() if k not in apart} == {k: v for k, v in direct.items() if k not in apart}
    assert [item["content"] for item in via["output"]] == [item["content"] for item in direct["output"]]
    [span] = await gw.store.query_spans(rollout_id, attempt_id)
    assert span.attributes["rollway.trainable"] is False  # SGLang's Responses API gives no token ids
