"""The real-engine suite: the official openai SDK → a real gateway (uvicorn, SQLite) → a real vLLM 0.32.0 (CPU
build, a tiny random-weight model; ``tests/support/vllm_env.py``), compared with the same request sent to vLLM
directly.

Every request carries a ``seed`` (temperature 1.0), so a direct call and a call through Rollway sample the same
tokens. The client must receive what the direct call answers, except for the fields that differ between any two
calls (``VOLATILE``: ids, timestamps); ``model`` is the engine's served name, passed through. The span holds the
engine's own token ids and logprobs, asked of it directly (``return_token_ids``, logprobs on), and so do the
triplets a trainer pulls.

A stream's chunking is not vLLM's to repeat: when its reader lags it sends the tokens of several engine steps in
one chunk, so the same request streams in 11 chunks one time and 12 the next. Streams are compared with their
chunks merged (``coalesced``): every field, every logprob entry in order, and the chunk that finishes each choice
(it carries ``system_fingerprint``).

Skipped with one line when the vLLM environment is missing (``bash .ci/vllm-venv`` builds it);
``ROLLWAY_REQUIRE_VLLM=1`` makes that a failure."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from rollway.store import Span
from support.gateway_harness import Alias, RunningGateway, claim_one, running_gateway
from support.vllm_env import (
    CHAT_MODEL,
    EMBED_MODEL,
    MAX_MODEL_LEN,
    START_TIMEOUT,
    Engine,
    Engines,
    require_vllm,
    running_engines,
)

require_vllm()  # the whole module skips, with one line, without the vLLM environment
# The first test also waits for the engines to start (``START_TIMEOUT``); each request is bounded by ``TIMEOUT``.
pytestmark = [pytest.mark.real_component, pytest.mark.timeout(START_TIMEOUT + 120)]

TIMEOUT = 60.0
SEED = 7
MESSAGES = [{"role": "user", "content": "What is the weather in paris?"}]
PROMPT = "Once upon a time"
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
#: A call in the markup of vLLM's ``hermes`` tool parser, forced by a regex (the model's weights are random, it
#: writes none by itself): with ``tool_choice: "auto"`` the parser turns it into a tool call.
CALL_REGEX = r'<tool_call>\{"name": "calculator", "arguments": \{"expression": "[0-9]{1,2}\+[0-9]{1,2}"\}\}</tool_call>'
#: What differs between any two calls: ids (of the answer, its items, its tool calls) and timestamps.
VOLATILE = frozenset({"id", "created", "created_at", "completed_at", "item_id", "call_id"})
SAMPLING: dict[str, Any] = {"seed": SEED, "temperature": 1.0}


def comparable(value: Any) -> Any:
    """An SDK object as the fields the server sent (``to_dict`` leaves out the ones it did not), volatile
    values masked (a volatile field present stays present)."""
    if isinstance(value, openai.BaseModel):
        value = value.to_dict()
    if isinstance(value, dict):
        return {k: "<volatile>" if k in VOLATILE and v is not None else comparable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [comparable(v) for v in value]
    return value


# -- fixtures ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    """The two vLLM servers, once per session."""
    with running_engines(tmp_path_factory.mktemp("vllm")) as running:
        yield running


def backend(engine: Engine, model: str) -> dict[str, Any]:
    """A ``vllm``-kind backend entry for ``engine``."""
    return {"backend_id": f"vllm-{engine.name}", "base_url": f"{engine.url}/v1", "kind": "vllm", "model": model}


@pytest.fixture
def gateway_aliases(engines: Engines) -> list[Alias]:
    """The gateway's alias ``policy`` is the chat engine and ``embedder`` the embedding engine."""
    return [
        Alias("policy", [backend(engines.chat, CHAT_MODEL)], version="v1"),
        Alias("embedder", [backend(engines.embed, EMBED_MODEL)], version="v1"),
    ]


@pytest.fixture
async def direct(engines: Engines) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(
        base_url=f"{engines.chat.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT
    ) as client:
        yield client


async def attempt_client(gw: RunningGateway) -> tuple[AsyncOpenAI, str, str]:
    """A client whose calls land in a claimed rollout's attempt: (client, rollout_id, attempt_id)."""
    rollout_id, attempt_id = await claim_one(gw.store)
    client = gw.client(f"{gw.url}/rollout/{rollout_id}/attempt/{attempt_id}/v1", timeout=TIMEOUT)
    return client, rollout_id, attempt_id


# -- asking -----------------------------------------------------------------------------------------------------


async def create(client: AsyncOpenAI, api: str, model: str, ask: dict[str, Any]) -> Any:
    methods: dict[str, Any] = {
        "chat": client.chat.completions.create,
        "completions": client.completions.create,
        "responses": client.responses.create,
        "embeddings": client.embeddings.create,
    }
    return await methods[api](model=model, **ask)


async def answer(client: AsyncOpenAI, api: str, model: str, ask: dict[str, Any]) -> list[Any]:
    """The answer (one item) or the stream's chunks (events), each as comparable data."""
    result = await create(client, api, model, ask)
    if ask.get("stream"):
        return [comparable(item) async for item in result]
    return [comparable(result)]


def chat_ask(**extra: Any) -> dict[str, Any]:
    return {"messages": MESSAGES, "max_tokens": 12, **SAMPLING, **extra}


def completion_ask(**extra: Any) -> dict[str, Any]:
    return {"prompt": PROMPT, "max_tokens": 12, **SAMPLING, **extra}


def ask_of(api: str, **extra: Any) -> dict[str, Any]:
    return chat_ask(**extra) if api == "chat" else completion_ask(**extra)


STREAMING = pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
APIS = pytest.mark.parametrize("api", ["chat", "completions"])


# -- the oracle -------------------------------------------------------------------------------------------------


@dataclass
class Truth:
    """What the engine generates for a request: its prompt's token ids, and per choice the sampled token ids
    and their logprobs."""

    prompt: list[int]
    token_ids: list[list[int]]
    logprobs: list[list[float]]


async def truth_of(direct: AsyncOpenAI, api: str, ask: dict[str, Any]) -> Truth:
    """``ask`` sent to the engine directly, whole, with token ids and logprobs."""
    ask = {k: v for k, v in ask.items() if k not in ("stream", "stream_options")}
    ask["extra_body"] = {**ask.get("extra_body", {}), "return_token_ids": True}
    if api == "chat":
        ask["logprobs"] = True
        body = (await direct.chat.completions.create(model=CHAT_MODEL, **ask)).to_dict()
        prompt = body["prompt_token_ids"]
        logprobs = [[e["logprob"] for e in c["logprobs"]["content"]] for c in body["choices"]]
    else:
        ask["logprobs"] = ask.get("logprobs") or 0
        body = (await direct.completions.create(model=CHAT_MODEL, **ask)).to_dict()
        prompt = body["choices"][0]["prompt_token_ids"]
        # An echo's logprobs start with the prompt's; the generated tokens' are the last ones.
        logprobs = [c["logprobs"]["token_logprobs"][-len(c["token_ids"]) :] for c in body["choices"]]
    return Truth(prompt, [c["token_ids"] for c in body["choices"]], logprobs)


async def only_span(gw: RunningGateway, rollout_id: str, attempt_id: str) -> Span:
    [span] = await gw.store.query_spans(rollout_id, attempt_id)
    return span


async def triplets_of(gw: RunningGateway, rollout_id: str, attempt_id: str) -> list[dict[str, Any]]:
    """The rollout's triplets as a trainer pulls them (``GET /admin/v1/triplets``), once its attempt succeeded."""
    await gw.store.update_attempt(rollout_id, attempt_id, status="succeeded")
    async with httpx.AsyncClient(base_url=gw.url, timeout=TIMEOUT) as admin:
        response = await admin.get("/admin/v1/triplets", params={"rollout_id": rollout_id})
    assert response.status_code == 200, response.text
    items: list[dict[str, Any]] = response.json()["items"]
    return items


async def assert_recorded(gw: RunningGateway, rollout_id: str, attempt_id: str, truth: Truth) -> None:
    """The call's span and its triplets hold exactly the engine's token ids and logprobs."""
    span = await only_span(gw, rollout_id, attempt_id)
    attrs = span.attributes
    assert span.status.status_code == "OK"
    assert attrs["rollway.prompt_token_ids"] == truth.prompt
    assert attrs["rollway.response_token_ids"] == truth.token_ids[0]
    assert attrs["rollway.response_logprobs"] == truth.logprobs[0]
    if len(truth.token_ids) > 1:
        choices = attrs["rollway.choices"]
        assert [c["token_ids"] for c in choices] == truth.token_ids
        assert [c["logprobs"] for c in choices] == truth.logprobs
    assert attrs["rollway.trainable"] is True
    assert attrs.get("gen_ai.usage.input_tokens") == len(truth.prompt)
    assert attrs.get("gen_ai.usage.output_tokens") == sum(len(ids) for ids in truth.token_ids)

    rows = await triplets_of(gw, rollout_id, attempt_id)
    got = [(t["choice_index"], t["prompt_token_ids"], t["response_token_ids"], t["response_logprobs"]) for t in rows]
    pairs = zip(truth.token_ids, truth.logprobs, strict=True)
    assert got == [(i, truth.prompt, ids, lps) for i, (ids, lps) in enumerate(pairs)]


def merged(old: Any, new: Any) -> Any:
    """Two consecutive pieces of one choice of a stream as one piece, the way vLLM coalesces the tokens of
    several engine steps into one chunk when its reader lags (so a stream's chunking varies from call to call):
    text and lists concatenated, objects merged key by key, tool-call deltas by their ``index``; a null adds
    nothing."""
    if new is None:
        return old
    if old is None:
        return new
    if isinstance(old, str) and isinstance(new, str):
        return old + new
    if isinstance(old, dict) and isinstance(new, dict):
        return {k: merged(old.get(k), new.get(k)) for k in old | new}
    if isinstance(old, list) and isinstance(new, list):
        if old and new and all(isinstance(x, dict) and "index" in x for x in old + new):  # tool-call deltas
            calls: dict[Any, Any] = {}
            for call in old + new:
                calls[call["index"]] = merged(calls.get(call["index"]), call)
            return list(calls.values())
        return old + new
    return new


def coalesced(chunks: list[Any]) -> dict[str, Any]:
    """A chat or text completion stream in a form its chunking does not change: the distinct chunk headers
    (all but ``choices``) in the order they first come, each choice merged whole (``merged``), and the header
    of the chunk that finished each choice (where vLLM puts ``system_fingerprint``)."""
    headers: list[Any] = []
    choices: dict[int, Any] = {}
    finished_in: dict[int, Any] = {}
    for chunk in chunks:
        header = {k: v for k, v in chunk.items() if k != "choices"}
        if header not in headers:
            headers.append(header)
        for choice in chunk.get("choices") or []:
            choices[choice["index"]] = merged(choices.get(choice["index"]), choice)
            if choice.get("finish_reason") is not None:
                finished_in[choice["index"]] = header
    return {"headers": headers, "choices": [choices[i] for i in sorted(choices)], "finished_in": finished_in}


#: The tokens that add no text to a Responses stream: the tiny model's special tokens, and one that decodes to "".
TEXTLESS = frozenset({"", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"})


def with_text(value: Any) -> Any:
    """``value`` without the logprob entries of tokens that add no text: vLLM's stream carries one only when its
    token shares a chunk with one that does (the reader lagged, and the engine's steps were sent together)."""
    if isinstance(value, dict):
        return {k: with_text(v) if k != "logprobs" else _entries_with_text(v) for k, v in value.items()}
    if isinstance(value, list):
        return [with_text(v) for v in value]
    return value


def _entries_with_text(entries: Any) -> Any:
    if not isinstance(entries, list):
        return with_text(entries)
    return [e for e in entries if not (isinstance(e, dict) and e.get("token") in TEXTLESS)]


def coalesced_events(events: list[Any]) -> list[Any]:
    """A Responses API stream in a form its chunking does not change: consecutive text deltas of one content
    part as one, sequence numbers (checked to count up from 0) left out, and logprobs only of tokens that add
    text (``with_text``)."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    out: list[Any] = []
    for event in map(with_text, events):
        event = {k: v for k, v in event.items() if k != "sequence_number"}
        if event["type"] == "response.output_text.delta" and out and _part(out[-1]) == _part(event):
            last = out[-1]
            out[-1] = last | {k: merged(last.get(k), event.get(k)) for k in ("delta", "logprobs")}
        else:
            out.append(event)
    return out


def _part(event: dict[str, Any]) -> list[Any]:
    return [event.get(k) for k in ("type", "item_id", "output_index", "content_index")]


def logprob_entries(items: list[Any]) -> list[Any]:
    """Every logprob entry of an answer or a stream: (choice index, entry), each choice's in order."""
    entries: list[Any] = []
    for item in items:
        for choice in item.get("choices") or []:
            logprobs = choice.get("logprobs") or {}
            if "content" in logprobs:  # chat
                entries += [(choice["index"], e) for e in logprobs["content"] or []]
            elif logprobs:  # text completion: parallel lists
                columns = [logprobs.get(k) or [] for k in ("tokens", "token_logprobs", "top_logprobs")]
                entries += [(choice["index"], *row) for row in zip(*columns, strict=True)]
    return sorted(entries, key=lambda entry: entry[0])  # stable: choices interleave as engine steps end


def says_nothing(chunk: dict[str, Any]) -> bool:
    """A chat chunk whose every choice has an empty delta and no finish reason: vLLM sends one (for a token its
    tool parser holds back, or part of a UTF-8 character) only to a request that asked for token ids or
    logprobs."""
    choices = chunk.get("choices") or []
    return bool(choices) and all(c.get("delta") == {} and c.get("finish_reason") is None for c in choices)


def assert_same_answer(via: list[Any], expected: list[Any], stream: bool) -> None:
    """The client's answer is the direct one: logprob entries first (their own diff), then every field; a stream
    chunk for chunk up to vLLM's coalescing (``coalesced``)."""
    assert logprob_entries(via) == logprob_entries(expected)
    if not stream:
        assert via == expected
        return
    ids = [c.get("token_ids") for chunk in expected for c in chunk.get("choices") or []]
    if not logprob_entries(expected) and not any(ids):  # asked for neither: the gateway's asking shows nothing
        assert [c for c in via if says_nothing(c)] == []
    got, want = coalesced(via), coalesced(expected)
    assert got["finished_in"] == want["finished_in"]  # system_fingerprint where the direct stream has it
    assert got == want


# -- chat and text completions ----------------------------------------------------------------------------------

USAGE = pytest.mark.parametrize(
    ("stream", "usage"),
    [(False, None), (True, None), (True, False), (True, True)],
    ids=["whole", "streamed", "streamed-usage-off", "streamed-usage-on"],
)


@APIS
@USAGE
async def test_an_answer_is_the_engines_and_its_span_and_triplet_hold_the_engines_tokens(
    gw: RunningGateway, direct: AsyncOpenAI, api: str, stream: bool, usage: bool | None
) -> None:
    """Streamed or not, with ``stream_options.include_usage`` on, off or absent."""
    extra: dict[str, Any] = {"stream": True} if stream else {}
    if usage is not None:
        extra["stream_options"] = {"include_usage": usage}
    ask = ask_of(api, **extra)
    client, rollout_id, attempt_id = await attempt_client(gw)
    via = await answer(client, api, "policy", ask)
    assert_same_answer(via, await answer(direct, api, CHAT_MODEL, ask), stream)
    assert via[0]["model"] == CHAT_MODEL  # the engine's served name, not the alias
    assert any(item.get("usage") for item in via) is (not stream or bool(usage))
    await assert_recorded(gw, rollout_id, attempt_id, await truth_of(direct, api, ask))


@APIS
@STREAMING
async def test_several_choices_are_the_engines_and_each_is_recorded(
    gw: RunningGateway, direct: AsyncOpenAI, api: str, stream: bool
) -> None:
    """``n`` > 1: one answer with every choice; the span's ``rollway.choices`` and one triplet per choice."""
    ask = ask_of(api, n=3, stream=stream)
    client, rollout_id, attempt_id = await attempt_client(gw)
    via = await answer(client, api, "policy", ask)
    assert_same_answer(via, await answer(direct, api, CHAT_MODEL, ask), stream)
    truth = await truth_of(direct, api, ask)
    assert len(truth.token_ids) == 3 and len(set(map(tuple, truth.token_ids))) > 1  # sampled apart
    await assert_recorded(gw, rollout_id, attempt_id, truth)


@APIS
@STREAMING
async def test_logprobs_with_top_logprobs_reach_the_client_entry_for_entry(
    gw: RunningGateway, direct: AsyncOpenAI, api: str, stream: bool
) -> None:
    """The client's own logprobs (three alternatives each): every entry a direct call carries, in order."""
    extra: dict[str, Any] = {"logprobs": True, "top_logprobs": 3} if api == "chat" else {"logprobs": 3}
    ask = ask_of(api, stream=stream, **extra)
    client, rollout_id, attempt_id = await attempt_client(gw)
    via = await answer(client, api, "policy", ask)
    expected = await answer(direct, api, CHAT_MODEL, ask)
    assert len(logprob_entries(expected)) == 12  # one per generated token
    assert_same_answer(via, expected, stream)
    await assert_recorded(gw, rollout_id, attempt_id, await truth_of(direct, api, ask))


TOOL_CHOICES: dict[str, dict[str, Any]] = {
    "auto-text": {"tool_choice": "auto"},
    "auto-call": {"tool_choice": "auto", "extra_body": {"structured_outputs": {"regex": CALL_REGEX}}},
    "named": {"tool_choice": {"type": "function", "function": {"name": "calculator"}}},
    "required": {"tool_choice": "required", "parallel_tool_calls": False},
}


@pytest.mark.parametrize("choice", list(TOOL_CHOICES))
@STREAMING
async def test_tool_calls_are_the_engines_parse_and_the_span_holds_their_tokens(
    gw: RunningGateway, direct: AsyncOpenAI, choice: str, stream: bool
) -> None:
    """vLLM's ``hermes`` parser with ``tool_choice`` auto (text, and a call), named and required."""
    ask = chat_ask(tools=[CALCULATOR], max_tokens=64, stream=stream, **TOOL_CHOICES[choice])
    client, rollout_id, attempt_id = await attempt_client(gw)
    via = await answer(client, "chat", "policy", ask)
    assert_same_answer(via, await answer(direct, "chat", CHAT_MODEL, ask), stream)
    # vLLM re-serializes the arguments of a whole answer (a number may become "Infinity") but streams them as
    # the model wrote them: the record is compared with what the client got.
    got = coalesced(via)["choices"][0]["delta"] if stream else via[0]["choices"][0]["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in got.get("tool_calls") or []]
    assert bool(calls) is (choice != "auto-text")
    await assert_recorded(gw, rollout_id, attempt_id, await truth_of(direct, "chat", ask))
    recorded = (await only_span(gw, rollout_id, attempt_id)).attributes["rollway.response"]["choices"][0]["message"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in recorded.get("tool_calls") or []] == calls


# -- text completion echo ---------------------------------------------------------------------------------------


@STREAMING
async def test_an_echo_is_the_engines_and_its_span_is_not_a_training_sample(
    gw: RunningGateway, direct: AsyncOpenAI, stream: bool
) -> None:
    """``echo`` alone: the gateway asks for no token ids (vLLM would leave the prompt's text out)."""
    ask = completion_ask(echo=True, stream=stream)
    client, rollout_id, attempt_id = await attempt_client(gw)
    via = await answer(client, "completions", "policy", ask)
    assert_same_answer(via, await answer(direct, "completions", CHAT_MODEL, ask), stream)
    text = "".join(c["choices"][0]["text"] for c in via if c.get("choices"))
    assert text.startswith(PROMPT) and len(text) > len(PROMPT)
    span = await only_span(gw, rollout_id, attempt_id)
    assert span.status.status_code == "OK" and span.attributes["rollway.trainable"] is False
    assert await triplets_of(gw, rollout_id, attempt_id) == []


@STREAMING
async def test_an_echo_that_asks_for_token_ids_and_logprobs_records_the_generated_ones(
    gw: RunningGateway, direct: AsyncOpenAI, stream: bool
) -> None:
    ask = completion_ask(echo=True, logprobs=2, stream=stream, extra_body={"return_token_ids": True})
    client, rollout_id, attempt_id = await attempt_client(gw)
    via = await answer(client, "completions", "policy", ask)
    assert_same_answer(via, await answer(direct, "completions", CHAT_MODEL, ask), stream)
    await assert_recorded(gw, rollout_id, attempt_id, await truth_of(direct, "completions", ask))


# -- the Responses API ------------------------------------------------------------------------------------------


def responses_ask(**extra: Any) -> dict[str, Any]:
    return {"input": "hello world", "max_output_tokens": 12, "temperature": 1.0, "extra_body": {"seed": SEED}} | extra


RESPONSE_LOGPROBS = {"top_logprobs": 2, "include": ["message.output_text.logprobs"]}


@pytest.mark.parametrize("logprobs", [False, True], ids=["plain", "logprobs"])
@STREAMING
async def test_a_response_is_the_engines(gw: RunningGateway, direct: AsyncOpenAI, stream: bool, logprobs: bool) -> None:
    """With the client's own logprobs (two alternatives each) or none."""
    ask = responses_ask(stream=stream, **(RESPONSE_LOGPROBS if logprobs else {}))
    client, _, _ = await attempt_client(gw)
    via = await answer(client, "responses", "policy", ask)
    expected = await answer(direct, "responses", CHAT_MODEL, ask)
    if stream:
        via, expected = coalesced_events(via), coalesced_events(expected)
    assert [event.get("type") for event in via] == [event.get("type") for event in expected]
    assert via == expected


@STREAMING
async def test_a_response_records_the_engines_token_ids_as_a_training_sample(
    gw: RunningGateway, direct: AsyncOpenAI, stream: bool
) -> None:
    """vLLM answers ``enable_response_messages: true`` with the prompt's and the output's tokens
    (``input_messages[0].tokens``, ``output_messages[0].tokens``): the span holds them, trainable."""
    ask = responses_ask(stream=stream)
    client, rollout_id, attempt_id = await attempt_client(gw)
    await answer(client, "responses", "policy", ask)
    whole = responses_ask(extra_body={"seed": SEED, "enable_response_messages": True})
    truth = (await direct.responses.create(model=CHAT_MODEL, **whole)).to_dict()
    span = await only_span(gw, rollout_id, attempt_id)
    attrs = span.attributes
    assert span.status.status_code == "OK"
    assert attrs.get("rollway.trainable") is True
    assert attrs.get("rollway.prompt_token_ids") == truth["input_messages"][0]["tokens"]
    assert attrs.get("rollway.response_token_ids") == truth["output_messages"][0]["tokens"]


async def test_a_response_is_a_triplet_with_the_engines_token_ids(gw: RunningGateway, direct: AsyncOpenAI) -> None:
    """A trainable Responses API call is a training sample like a chat completion."""
    client, rollout_id, attempt_id = await attempt_client(gw)
    await answer(client, "responses", "policy", responses_ask())
    whole = responses_ask(extra_body={"seed": SEED, "enable_response_messages": True})
    truth = (await direct.responses.create(model=CHAT_MODEL, **whole)).to_dict()
    rows = await triplets_of(gw, rollout_id, attempt_id)
    assert [(t["prompt_token_ids"], t["response_token_ids"]) for t in rows] == [
        (truth["input_messages"][0]["tokens"], truth["output_messages"][0]["tokens"])
    ]
    assert rows[0]["messages"][-1] == {"role": "user", "content": whole["input"]}


# -- logprobs the engine leaves out -----------------------------------------------------------------------------

#: Token ids that end an answer (a quarter of the vocabulary), for a random-weight model that left to itself
#: writes until ``max_tokens``: its sampling is not constrained, so its sampled logprobs are the model's own.
STOP_IDS = list(range(4, 1024, 4))
#: The calculator as a Responses API function tool.
RESPONSES_CALCULATOR = {
    "type": "function",
    "name": "calculator",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
}
#: How far a logprob the engine scored (``prompt_logprobs``) may be from the one it sampled for the same token
#: after the same tokens: both come from the same raw logits, computed in another batch shape.
SCORE_TOLERANCE = 1e-3


async def echoed_scores(direct: AsyncOpenAI, span: Span) -> Truth:
    """The span's prompt and output ids sent back as one prompt, echoed with logprobs: the engine's logprob of
    each output token after the ones before it, asked another way. The truth for a call sampled under a
    constraint, whose sampled logprobs are those of the constrained distribution (0 for a forced token)."""
    attrs = span.attributes
    prompt, output = attrs["rollway.prompt_token_ids"], attrs["rollway.response_token_ids"]
    echoed = await direct.completions.create(
        model=CHAT_MODEL, prompt=[*prompt, *output], max_tokens=1, echo=True, logprobs=0
    )
    assert echoed.choices[0].logprobs is not None
    values = echoed.choices[0].logprobs.token_logprobs or []
    return Truth(prompt, [output], [values[len(prompt) : len(prompt) + len(output)]])


def assert_scored_like_sampled(span: Span, truth: Truth, source: frozenset[str] = frozenset({"scored"})) -> None:
    attrs = span.attributes
    assert attrs["rollway.logprobs_complete"] is True and attrs["rollway.logprobs_source"] in source
    assert attrs["rollway.response_token_ids"] == truth.token_ids[0]
    scored, sampled = attrs["rollway.response_logprobs"], truth.logprobs[0]
    assert len(scored) == len(sampled)
    assert max(abs(a - b) for a, b in zip(scored, sampled, strict=True)) <= SCORE_TOLERANCE, (scored, sampled)


@STREAMING
async def test_a_responses_tool_call_gets_the_logprobs_the_engine_left_out(
    gw: RunningGateway, direct: AsyncOpenAI, stream: bool
) -> None:
    """vLLM's Responses API gives no logprob for a function call's tokens (nor, streamed, for a token without
    text): Rollway has the engine score the output. The call is forced (a regex: the weights are random), so the
    engine's sampled logprobs are the constrained ones; the scores are the model's own, as an echo gives them."""
    forced = {"seed": SEED, "structured_outputs": {"regex": CALL_REGEX}}
    ask = responses_ask(tools=[RESPONSES_CALCULATOR], max_output_tokens=64, stream=stream, extra_body=forced)
    client, rollout_id, attempt_id = await attempt_client(gw)
    via = await answer(client, "responses", "policy", ask)
    items = via[-1]["response"]["output"] if stream else via[0]["output"]
    assert [item["type"] for item in items] == ["function_call"]
    span = await only_span(gw, rollout_id, attempt_id)
    assert_scored_like_sampled(span, await echoed_scores(direct, span))


async def test_a_streamed_response_gets_its_logprobs_scored_as_sampled(gw: RunningGateway, direct: AsyncOpenAI) -> None:
    """A streamed text answer: the one the engine gives whole, with its logprobs, is the truth."""
    client, rollout_id, attempt_id = await attempt_client(gw)
    await answer(client, "responses", "policy", responses_ask(stream=True))
    whole = responses_ask(extra_body={"seed": SEED, "enable_response_messages": True}, **RESPONSE_LOGPROBS)
    truth = (await direct.responses.create(model=CHAT_MODEL, **whole)).to_dict()
    span = await only_span(gw, rollout_id, attempt_id)
    sampled = [entry["logprob"] for entry in truth["output"][0]["content"][0]["logprobs"]]
    # Scored when the stream left out a textless token's logprob; whole when the reader lagged and it did not.
    truth_of_stream = Truth([], [truth["output_messages"][0]["tokens"]], [sampled])
    assert_scored_like_sampled(span, truth_of_stream, source=frozenset({"scored", "sampled"}))


@STREAMING
async def test_an_openai_agents_run_on_its_default_responses_model_has_every_logprob(
    gw: RunningGateway, direct: AsyncOpenAI, stream: bool
) -> None:
    """openai-agents 0.24 on its default model class (the Responses API), with a function tool: the first turn
    is forced to call it (the model's weights are random), the second answers in text, sampled freely and ended
    by ``STOP_IDS``. Every turn's span holds a logprob for every output token: the tool call's scored (as an echo
    gives them: its sampling was constrained), the answer's within ``SCORE_TOLERANCE`` of the logprobs the engine
    samples the same tokens with (scored when the stream leaves the end token's out)."""
    import agents  # openai-agents, from the test extra

    agents.set_tracing_disabled(True)  # its traces would go to api.openai.com, with the rollout's key
    calls: list[str] = []
    forced: dict[str, Any] = {"seed": SEED, "structured_outputs": {"regex": CALL_REGEX}}

    # Not strict: vLLM would constrain a strict tool's call by its schema instead of by ``forced``'s regex.
    @agents.function_tool(strict_mode=False)
    def calculator(expression: str) -> str:
        """Evaluate an addition."""
        calls.append(expression)
        forced.pop("structured_outputs")  # the next turn is the model's own, ended by ``STOP_IDS``
        forced["stop_token_ids"] = STOP_IDS
        return str(sum(int(term) for term in expression.split("+")))

    client, rollout_id, attempt_id = await attempt_client(gw)
    model = agents.OpenAIResponsesModel(model="policy", openai_client=client)
    settings = agents.ModelSettings(max_tokens=64, temperature=1.0, extra_body=forced)
    agent = agents.Agent(name="adder", instructions="Add.", tools=[calculator], model=model, model_settings=settings)
    if stream:
        streamed = agents.Runner.run_streamed(agent, "What is 2+2?", max_turns=3)
        async for _ in streamed.stream_events():
            pass
    else:
        await agents.Runner.run(agent, "What is 2+2?", max_turns=3)
    assert len(calls) == 1
    spans = await gw.store.query_spans(rollout_id, attempt_id)
    assert [s.attributes["rollway.stream"] for s in spans] == [stream, stream]
    tool_turn, text_turn = spans
    assert_scored_like_sampled(tool_turn, await echoed_scores(direct, tool_turn))
    attrs = text_turn.attributes
    replay = {"prompt": attrs["rollway.prompt_token_ids"], "max_tokens": 64, "temperature": 1.0}
    truth = await truth_of(direct, "completions", replay | {"extra_body": {"seed": SEED, "stop_token_ids": STOP_IDS}})
    # Streamed, the end token's logprob is left out (then scored) unless it shared a chunk with a token that has
    # text, which happens when the reader lags behind the engine.
    sources = frozenset({"scored", "sampled"}) if stream else frozenset({"sampled"})
    assert_scored_like_sampled(text_turn, truth, source=sources)


# -- embeddings -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", ["float", "base64"])
async def test_embeddings_pass_through_unchanged(gw: RunningGateway, engines: Engines, encoding: str) -> None:
    """``base64`` is what the SDK asks for when the caller names no format (it decodes the answer)."""
    ask: dict[str, Any] = {"input": ["hello world", "the weather in paris"]}
    if encoding == "float":
        ask["encoding_format"] = "float"
    client, rollout_id, attempt_id = await attempt_client(gw)
    via = await create(client, "embeddings", "embedder", ask)
    async with AsyncOpenAI(
        base_url=f"{engines.embed.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT
    ) as direct:
        expected = await create(direct, "embeddings", EMBED_MODEL, ask)
    assert [d.embedding for d in via.data] == [d.embedding for d in expected.data]
    assert len(via.data) == 2 and len(via.data[0].embedding) > 0
    assert comparable(via) == comparable(expected)
    span = await only_span(gw, rollout_id, attempt_id)
    assert span.status.status_code == "OK" and span.attributes["gen_ai.operation.name"] == "embeddings"
    assert span.attributes["rollway.trainable"] is False


# -- engine errors ----------------------------------------------------------------------------------------------


#: More tokens than the context holds (each "hello world " is at least one).
TOO_LONG = "hello world " * MAX_MODEL_LEN
ERRORS: dict[str, dict[str, dict[str, Any]]] = {
    "max-tokens": {
        "chat": chat_ask(max_tokens=MAX_MODEL_LEN + 1),
        "completions": completion_ask(max_tokens=MAX_MODEL_LEN + 1),
        "responses": responses_ask(max_output_tokens=MAX_MODEL_LEN + 1),
    },
    "long-prompt": {
        "chat": chat_ask(messages=[{"role": "user", "content": TOO_LONG}]),
        "completions": completion_ask(prompt=TOO_LONG),
        "responses": responses_ask(input=TOO_LONG),
    },
}


@pytest.mark.parametrize("error", list(ERRORS))
@pytest.mark.parametrize("api", ["chat", "completions", "responses"])
@STREAMING
async def test_an_engine_4xx_reaches_the_client_unchanged(
    gw: RunningGateway, direct: AsyncOpenAI, api: str, error: str, stream: bool
) -> None:
    """``max_tokens`` beyond the context (refused before the prompt is read), a prompt longer than the context
    (refused once tokenized): vLLM's 400, status and body as a direct call gets them; the span is an error and
    no training sample."""
    ask = ERRORS[error][api] | {"stream": stream}
    client, rollout_id, attempt_id = await attempt_client(gw)
    with pytest.raises(openai.APIStatusError) as via:
        await answer(client, api, "policy", ask)
    with pytest.raises(openai.APIStatusError) as expected:
        await answer(direct, api, CHAT_MODEL, ask)
    assert expected.value.status_code == 400
    assert via.value.status_code == expected.value.status_code
    assert via.value.response.json() == expected.value.response.json()
    span = await only_span(gw, rollout_id, attempt_id)
    assert span.status.status_code == "ERROR" and span.attributes["rollway.trainable"] is False
    assert span.attributes["http.response.status_code"] == 400
    assert await triplets_of(gw, rollout_id, attempt_id) == []


# -- an alias that names no kind --------------------------------------------------------------------------------


@APIS
async def test_an_alias_without_a_kind_finds_vllm_and_records_trainable_spans(
    tmp_path: Path, engines: Engines, direct: AsyncOpenAI, api: str
) -> None:
    """No ``kind``: the default (``auto``) asks the backend's ``GET /version`` and finds vLLM."""
    no_kind = {k: v for k, v in backend(engines.chat, CHAT_MODEL).items() if k != "kind"}
    async with running_gateway(tmp_path) as gw:
        await gw.store.put_model("policy", [no_kind], version="v1")
        ask = ask_of(api)
        client, rollout_id, attempt_id = await attempt_client(gw)
        via = await answer(client, api, "policy", ask)
        assert_same_answer(via, await answer(direct, api, CHAT_MODEL, ask), stream=False)
        await assert_recorded(gw, rollout_id, attempt_id, await truth_of(direct, api, ask))
