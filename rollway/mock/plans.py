"""Turning a request body into a ``Plan``: vLLM's checks (``rollway.mock.validation``), the prompt's token ids, the
fake model's choices and the renderer of the answer (a JSON body, or stream chunks grouped by decode step)."""

from __future__ import annotations

import base64
import random
import struct
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from rollway.mock import asks, completions, responses, shapes
from rollway.mock import tokenizer as tok
from rollway.mock import validation as check
from rollway.mock.answer import Answer
from rollway.mock.config import MockConfig
from rollway.mock.identity import VLLM_VERSION, random_id, system_fingerprint
from rollway.mock.model import Choice, FakeModel, PrefixCache, Sampling, ToolSpec, prompt_digest
from rollway.mock.response_items import LOGPROBS_INCLUDE, ResponseAnswer
from rollway.mock.shapes import ToolMode
from rollway.mock.validation import BadRequest, rejected, schema_error


class Backend(Protocol):
    """What planning needs from the app's state."""

    config: MockConfig
    model: FakeModel
    prefix_cache: PrefixCache


@dataclass
class Plan:
    """What to answer: a JSON body, or stream steps (lists of chunks per decode step)."""

    model: str
    stream: bool
    decode_steps: int
    #: The JSON body (None: an empty one).
    body: Callable[[], dict[str, Any] | str | None] | None = None
    steps: Callable[[], list[list[dict[str, Any]]]] | None = None
    #: Stream events named by an ``event:`` line (each chunk's ``type``) and no ``[DONE]`` (the Responses API).
    named_events: bool = False
    #: The ``event:`` name of a chunk of a stream that ends with ``[DONE]`` (None: a plain ``data:`` event).
    event_name: Callable[[dict[str, Any]], str | None] | None = None
    #: The status of the body (an answer that is an error).
    status: int = 200


@dataclass(frozen=True, slots=True)
class Reply:
    """The fake model's answer to a conversation: the rendered prompt, the sampling it used, its choices, and the
    prompt tokens the prefix cache held and those it wrote."""

    prompt_ids: list[int]
    prompt_text: str
    sampling: Sampling
    choices: list[Choice]
    cached: int
    written: int


class Planner:
    """Plans the answers of one route (``kind``: chat, completions, embeddings, responses, models, version,
    health)."""

    def __init__(self, state: Backend, kind: str) -> None:
        self.state, self.kind = state, kind

    def plan(
        self,
        body: dict[str, Any],
        request_id: str | None = None,
        headers: Mapping[str, str] | None = None,
        params: Mapping[str, str] | None = None,
    ) -> Plan:
        """The plan of ``body``; ``request_id`` (the client's ``X-Request-Id``) names chat and completion answers,
        as vLLM's do. ``headers`` and the route's path ``params`` are for other engines' routes."""
        if self.kind == "chat":
            return self._plan_chat(body, request_id)
        if self.kind == "completions":
            return self._plan_completions(body, request_id)
        if self.kind == "embeddings":
            return self._plan_embeddings(body)
        if self.kind == "responses":
            return self._plan_responses(body)
        if self.kind == "models":
            return Plan("", False, 0, body=self._models)
        if self.kind == "version":
            return Plan("", False, 0, body=lambda: {"version": VLLM_VERSION})
        return Plan("", False, 0, body=lambda: None)  # /health: 200 with no body

    def error(self, exc: BadRequest) -> dict[str, Any]:
        """The body of a refused request."""
        return exc.body()

    # -- shared -------------------------------------------------------------------------------------------

    def _model_name(self, body: dict[str, Any], *, aliases: bool = True) -> str:
        """The model asked for; vLLM serves its first model to a request that names none."""
        config = self.state.config
        model = body.get("model")
        if model is None or model == "":
            return config.models[0]
        if not isinstance(model, str):
            raise schema_error("body.model", "string_type", "Input should be a valid string", model)
        if config.strict_models and model not in config.models:
            raise check.unknown_model(model, config.models, aliases=aliases)
        return model

    def _models(self) -> dict[str, Any]:
        config, created = self.state.config, int(time.time())
        permission = {
            "object": "model_permission",
            "created": created,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "vllm",
                    "root": name,
                    "parent": None,
                    "max_model_len": config.max_model_len,
                    "permission": [{"id": f"modelperm-{random_id()}", **permission}],
                }
                for name in config.models
            ],
        }

    def _options(self, **asked: Any) -> shapes.Options:
        config = self.state.config
        fingerprint = system_fingerprint(config.models, config.max_model_len)
        return shapes.Options(fingerprint=fingerprint, prompt_details=config.prompt_tokens_details, **asked)

    def _messages(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        raw = check.sequence(body, "messages")
        if raw is None:
            raise check.missing(body, "messages")
        if not raw:
            raise BadRequest("Cannot apply chat template to an empty conversation. Provide at least one message.")
        for i, message in enumerate(raw):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise schema_error(f"body.messages.{i}.role", "missing", "Field required", message)
            try:
                tok.content_text(message.get("content"))
            except ValueError as exc:
                raise schema_error(f"body.messages.{i}.content", "list_type", str(exc), message) from exc
        return raw

    def _cache(self, model: str, prompt_ids: list[int]) -> tuple[int, int]:
        return self.state.prefix_cache.lookup_and_insert(model, prompt_ids)

    def _tool(
        self, body: dict[str, Any], messages: list[dict[str, Any]], *, flat: bool
    ) -> tuple[ToolSpec | None, ToolMode]:
        """The tool to call and how it was asked for; the fake model calls a tool on its own only to answer the
        user."""
        tool, mode = asks.tool_spec(body, flat=flat)
        if mode == "auto" and messages[-1]["role"] != "user":
            tool = None
        return tool, mode

    def _reply(
        self, model: str, body: dict[str, Any], messages: list[dict[str, Any]], max_tokens: int, tool: ToolSpec | None
    ) -> Reply:
        """The fake model's answer to the conversation's last user message."""
        prompt_ids, prompt_text = tok.render_chat(messages, body.get("tools"))
        sampling = asks.sampling(body, max_tokens, len(prompt_ids), self.state.config.max_model_len)
        user = next((m for m in reversed(messages) if m["role"] == "user"), None)
        user_text = tok.content_text(user.get("content")) if user else ""
        choices = self.state.model.generate(prompt_ids, sampling, user_text=user_text, tool=tool)
        cached, written = self._cache(model, prompt_ids)
        return Reply(prompt_ids, prompt_text, sampling, choices, cached, written)

    def _response_reply(
        self, model: str, body: dict[str, Any], messages: list[dict[str, Any]], max_tokens: int
    ) -> Reply:
        """The fake model's answer to a Responses API request: one choice (``n`` does not apply), its tools flat."""
        tool, _ = self._tool(body, messages, flat=True)
        return self._reply(model, {**body, "n": 1}, messages, max_tokens, tool)

    def _complete(
        self, model: str, body: dict[str, Any], prompts: list[tuple[list[int], str]], max_tokens: int
    ) -> tuple[list[tuple[list[int], list[Choice]]], int, int]:
        """Each prompt's ids and the fake model's choices for it, and the prefix cache's report of the last prompt
        (the one an engine reports)."""
        batches: list[tuple[list[int], list[Choice]]] = []
        cached = written = 0
        for ids, text in prompts:
            sampling = asks.sampling(body, max_tokens, len(ids), self.state.config.max_model_len)
            batches.append((ids, self.state.model.generate(ids, sampling, user_text=text)))
            cached, written = self._cache(model, ids)
        return batches, cached, written

    def _limit(self, body: dict[str, Any], keys: tuple[str, ...], default: int) -> int:
        """The output limit: the first of ``keys`` the body gives (each one checked), else ``default``."""
        limit = self.state.config.max_model_len
        given = [check.max_tokens(body, key, 0, limit) for key in keys]
        return next((value for value in given if value), default)

    # -- chat ---------------------------------------------------------------------------------------------

    def _plan_chat(self, body: dict[str, Any], request_id: str | None) -> Plan:
        model = self._model_name(body)
        messages = self._messages(body)
        max_tokens = self._limit(body, ("max_completion_tokens", "max_tokens"), self.state.config.default_max_tokens)
        logprobs = check.boolean(body, "logprobs")
        top = check.integer(body, "top_logprobs") or 0
        if top < -1:
            raise rejected("`top_logprobs` must be a positive value or -1.", "top_logprobs", top)
        if top and not logprobs:
            raise rejected("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
        stream = check.boolean(body, "stream")
        stream_options = asks.stream_options(body, stream)
        tool, mode = self._tool(body, messages, flat=False)
        opts = self._options(
            return_token_ids=check.boolean(body, "return_token_ids"),
            logprobs=logprobs,
            top_logprobs=check.logprobs_count(top),
            include_usage=stream_options.get("include_usage") is True,
            continuous_usage=stream_options.get("continuous_usage_stats") is True,
            tool_mode=mode,
        )
        reply = self._reply(model, body, messages, max_tokens, tool)
        answer_id = "chatcmpl-" + (request_id or random_id())
        batches = [(reply.prompt_ids, reply.choices)]
        answer = Answer(answer_id, int(time.time()), model, batches, reply.cached, opts, created_cache=reply.written)
        steps = max(len(c.tokens) for c in reply.choices)
        if stream:
            return Plan(model, True, steps, steps=lambda: shapes.chat_stream_steps(answer))
        return Plan(model, False, steps, body=lambda: shapes.chat_response(answer))

    # -- completions ----------------------------------------------------------------------------------------

    def _prompts(self, body: dict[str, Any], key: str) -> list[tuple[list[int], str]]:
        def ids_ok(x: Any) -> bool:
            return isinstance(x, list) and bool(x) and all(isinstance(i, int) and not isinstance(i, bool) for i in x)

        raw: Any = body.get(key)
        if raw == []:
            raise BadRequest("You must pass at least one prompt")
        if isinstance(raw, str):
            return [(tok.encode(raw), raw)]
        if ids_ok(raw):
            return [(list(raw), tok.decode(raw))]
        if isinstance(raw, list) and all(isinstance(p, str) for p in raw):
            return [(tok.encode(p), p) for p in raw]
        if isinstance(raw, list) and all(ids_ok(p) for p in raw):
            return [(list(p), tok.decode(p)) for p in raw]
        raise schema_error(f"body.{key}", "string_type", "Input should be a valid string", raw)

    def _plan_completions(self, body: dict[str, Any], request_id: str | None) -> Plan:
        model = self._model_name(body)
        if body.get("prompt") in (None, ""):
            raise rejected("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
        prompts = self._prompts(body, "prompt")
        max_tokens = self._limit(body, ("max_tokens",), 16)
        top = check.integer(body, "logprobs")
        prompt_top = check.integer(body, "prompt_logprobs")
        stream = check.boolean(body, "stream")
        stream_options = asks.stream_options(body, stream)
        opts = self._options(
            return_token_ids=check.boolean(body, "return_token_ids"),
            logprobs=top is not None,
            top_logprobs=check.logprobs_count(top) if top is not None else 0,
            include_usage=stream_options.get("include_usage") is True,
            continuous_usage=stream_options.get("continuous_usage_stats") is True,
            echo=check.boolean(body, "echo"),
            prompt_logprobs=check.logprobs_count(prompt_top) if prompt_top is not None else None,
            weights=self.state.model.weights,
        )
        batches, cached, written = self._complete(model, body, prompts, max_tokens)
        texts = tuple(text for _, text in prompts)
        answer_id = "cmpl-" + (request_id or random_id())
        answer = Answer(answer_id, int(time.time()), model, batches, cached, opts, texts, written)
        steps = max(len(c.tokens) for _, cs in batches for c in cs)
        if stream:
            return Plan(model, True, steps, steps=lambda: completions.completion_stream_steps(answer))
        return Plan(model, False, steps, body=lambda: completions.completion_response(answer))

    # -- embeddings -----------------------------------------------------------------------------------------

    def _plan_embeddings(self, body: dict[str, Any]) -> Plan:
        model = self._model_name(body, aliases=False)
        if body.get("input") is None:
            raise check.missing(body, "input")
        if body["input"] == "":
            raise BadRequest("The decoder prompt cannot be empty")
        inputs = self._prompts(body, "input")
        for ids, _ in inputs:
            check.prompt_length(len(ids), self.state.config.max_model_len)
        dims = check.integer(body, "dimensions") or self.state.config.embedding_dim
        if dims < 1:
            raise rejected(f"dimensions must be at least 1, got {dims}.", "dimensions", dims)
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            expected = "'float', 'base64', 'bytes' or 'bytes_only'"
            msg = f"Input should be {expected}"
            raise schema_error("body.encoding_format", "literal_error", msg, fmt, {"expected": expected})
        answer_id, created = f"embd-{random_id()}", int(time.time())

        def build() -> dict[str, Any]:
            data = []
            for index, (ids, _) in enumerate(inputs):
                vector = _embedding(ids, dims)
                value: Any = vector
                if fmt == "base64":
                    value = base64.b64encode(struct.pack(f"<{dims}f", *vector)).decode("ascii")
                data.append({"index": index, "object": "embedding", "embedding": value})
            n = sum(len(ids) for ids, _ in inputs)
            return {
                "id": answer_id,
                "object": "list",
                "created": created,
                "model": model,
                "data": data,
                "usage": shapes.usage(n, 0),
            }

        return Plan(model, False, 1, body=build)

    # -- responses ------------------------------------------------------------------------------------------

    def _response_messages(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if isinstance(body.get("instructions"), str):
            messages.append({"role": "system", "content": body["instructions"]})
        raw = body.get("input")
        if raw is None:
            raise check.missing(body, "input")
        if isinstance(raw, str):
            return [*messages, {"role": "user", "content": raw}]
        if not isinstance(raw, list):
            raise schema_error("body.input", "string_type", "Input should be a valid string", raw)
        for i, item in enumerate(raw):
            if not isinstance(item, dict):
                raise schema_error(f"body.input.{i}", "model_type", "Input should be a valid dictionary", item)
            kind = item.get("type", "message")
            if kind == "message" and isinstance(item.get("role"), str):
                messages.append({"role": item["role"], "content": item.get("content")})
            elif kind == "function_call":
                call = {"id": item.get("call_id"), "type": "function", "function": item}
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                messages.append({"role": "tool", "content": str(item.get("output", ""))})
        return self._messages({"messages": messages})

    def _plan_responses(self, body: dict[str, Any]) -> Plan:
        model = self._model_name(body)
        stream = check.boolean(body, "stream")
        messages = self._response_messages(body)
        max_output = self._limit(body, ("max_output_tokens",), self.state.config.default_max_tokens)
        include = check.sequence(body, "include") or []
        logprobs = LOGPROBS_INCLUDE in include
        top = check.logprobs_count(check.integer(body, "top_logprobs") or 0)
        reply = self._response_reply(model, body, messages, max_output)
        choice = reply.choices[0]
        answer = ResponseAnswer(
            id=f"resp_{random_id()}",
            created=int(time.time()),
            model=model,
            choice=choice,
            prompt_ids=reply.prompt_ids,
            prompt_text=reply.prompt_text,
            cached=reply.cached,
            created_cache=reply.written,
            request=body,
            max_output_tokens=reply.sampling.max_tokens,
            item_key=random_id(),
            logprobs=logprobs,
            top_logprobs=top,
            messages=check.boolean(body, "enable_response_messages"),
        )
        steps = len(choice.tokens)
        if stream:
            return Plan(model, True, steps, steps=lambda: responses.response_stream_steps(answer), named_events=True)
        return Plan(model, False, steps, body=lambda: responses.response_body(answer))


def _embedding(ids: list[int], dims: int) -> list[float]:
    rng = random.Random(prompt_digest(ids))
    vector = [rng.gauss(0.0, 1.0) for _ in range(dims)]
    norm = sum(v * v for v in vector) ** 0.5 or 1.0
    return [round(v / norm, 7) for v in vector]
