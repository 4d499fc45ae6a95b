"""Turning a request body into a ``Plan``: validation (400s in OpenAI's envelope), the prompt's token ids, the fake
model's choices and the renderer of the answer (a JSON body, or stream chunks grouped by decode step)."""

from __future__ import annotations

import base64
import random
import struct
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from rollway.mock import shapes
from rollway.mock import tokenizer as tok
from rollway.mock.config import MockConfig
from rollway.mock.model import Choice, FakeModel, PrefixCache, Sampling, ToolSpec, prompt_digest


class BadRequest(Exception):
    def __init__(
        self, message: str, param: str | None = None, *, status: int = 400, type_: str = "invalid_request_error"
    ):
        super().__init__(message)
        self.message, self.param, self.status, self.type = message, param, status, type_


class Backend(Protocol):
    """What planning needs from the app's state."""

    config: MockConfig
    model: FakeModel
    prefix_cache: PrefixCache


# ---------------------------------------------------------------------------------------------- validation


def _int(body: dict[str, Any], key: str, default: int | None, lo: int, hi: int) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise BadRequest(f"{key} must be an integer between {lo} and {hi}", key)
    return value


def _bool(body: dict[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise BadRequest(f"{key} must be a boolean", key)
    return bool(value)


def _float(body: dict[str, Any], key: str, lo: float, hi: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise BadRequest(f"{key} must be a number between {lo} and {hi}", key)
    return float(value)


def _sampling(body: dict[str, Any], max_tokens: int) -> Sampling:
    return Sampling(
        max_tokens=max_tokens,
        n=_int(body, "n", 1, 1, 128) or 1,
        seed=_int(body, "seed", None, -(2**63), 2**64),
        temperature=_float(body, "temperature", 0.0, 2.0),
        min_tokens=_int(body, "min_tokens", 0, 0, 1_000_000) or 0,
        ignore_eos=_bool(body, "ignore_eos"),
    )


@dataclass
class Plan:
    """What to answer: a JSON body, or stream steps (lists of chunks per decode step)."""

    model: str
    stream: bool
    decode_steps: int
    body: Callable[[], dict[str, Any]] | None = None
    steps: Callable[[], list[list[dict[str, Any]]]] | None = None
    #: Stream events named by an ``event:`` line (each chunk's ``type``) and no ``[DONE]`` (the Responses API).
    named_events: bool = False


def _tool_spec(tools: Any, tool_choice: Any, *, flat: bool) -> ToolSpec | None:
    """The tool to call (first one, or the named one), or None when the model should answer with text."""
    if not tools or tool_choice == "none":
        return None
    specs: list[ToolSpec] = []
    for i, tool in enumerate(tools):
        fn = tool if flat else (tool.get("function") if isinstance(tool, dict) else None)
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest(f"tools[{i}] must be a function tool with a name", "tools")
        params = fn.get("parameters")
        specs.append(ToolSpec(fn["name"], params if isinstance(params, dict) else {}))
    if isinstance(tool_choice, dict):
        named = tool_choice.get("name") if flat else (tool_choice.get("function") or {}).get("name")
        for spec in specs:
            if spec.name == named:
                return spec
        raise BadRequest(f"tool_choice names an unknown tool {named!r}", "tool_choice")
    return specs[0]


class Planner:
    """Plans the answers of one route (``kind``: chat, completions, embeddings, responses, models, health)."""

    def __init__(self, state: Backend, kind: str) -> None:
        self.state, self.kind = state, kind

    def plan(self, body: dict[str, Any]) -> Plan:
        if self.kind == "models":
            return Plan("", False, 0, body=self._models)
        if self.kind == "health":
            return Plan("", False, 0, body=lambda: {"status": "ok"})
        planner = {
            "chat": self._plan_chat,
            "completions": self._plan_completions,
            "embeddings": self._plan_embeddings,
            "responses": self._plan_responses,
        }[self.kind]
        return planner(body)

    def _model_name(self, body: dict[str, Any]) -> str:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise BadRequest("model is required", "model")
        if self.state.config.strict_models and model not in self.state.config.models:
            raise BadRequest(f"The model `{model}` does not exist.", "model", status=404, type_="NotFoundError")
        return model

    def _models(self) -> dict[str, Any]:
        config = self.state.config
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "rollway-mock",
                    "root": name,
                    "parent": None,
                    "max_model_len": config.max_model_len,
                    "permission": [],
                }
                for name in config.models
            ],
        }

    def _messages(self, raw: Any) -> list[dict[str, Any]]:
        if not isinstance(raw, list) or not raw:
            raise BadRequest("messages must be a non-empty list", "messages")
        for i, message in enumerate(raw):
            if not isinstance(message, dict) or message.get("role") not in tok.ROLES:
                raise BadRequest(f"messages[{i}] must be an object with a valid role", "messages")
            try:
                tok.content_text(message.get("content"))
            except ValueError as exc:
                raise BadRequest(f"messages[{i}].{exc}", "messages") from exc
        return raw

    def _cached(self, model: str, prompt_ids: list[int]) -> int:
        return self.state.prefix_cache.lookup_and_insert(model, prompt_ids)

    def _plan_chat(self, body: dict[str, Any]) -> Plan:
        model = self._model_name(body)
        messages = self._messages(body.get("messages"))
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise BadRequest("tools must be a list", "tools")
        max_tokens = _int(body, "max_completion_tokens", None, 1, 10_000_000) or _int(
            body, "max_tokens", self.state.config.default_max_tokens, 1, 10_000_000
        )
        sampling = _sampling(body, max_tokens or 1)
        logprobs = _bool(body, "logprobs")
        top = _int(body, "top_logprobs", 0, 0, 20) or 0
        if top and not logprobs:
            raise BadRequest("top_logprobs requires logprobs to be true", "top_logprobs")
        stream = _bool(body, "stream")
        stream_options = body.get("stream_options") or {}
        if not isinstance(stream_options, dict):
            raise BadRequest("stream_options must be an object", "stream_options")
        opts = shapes.Options(
            return_token_ids=_bool(body, "return_token_ids"),
            logprobs=logprobs,
            top_logprobs=top,
            include_usage=stream_options.get("include_usage") is True,
            continuous_usage=stream_options.get("continuous_usage_stats") is True,
        )
        tool = None
        if messages[-1]["role"] == "user":
            tool = _tool_spec(tools, body.get("tool_choice", "auto"), flat=False)
        prompt_ids, _ = tok.render_chat(messages, tools)
        user = next((m for m in reversed(messages) if m["role"] == "user"), None)
        user_text = tok.content_text(user.get("content")) if user else ""
        choices = self.state.model.generate(prompt_ids, sampling, user_text=user_text, tool=tool)
        cached = self._cached(model, prompt_ids)
        answer = shapes.Answer(
            f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model, [(prompt_ids, choices)], cached, opts
        )
        steps = max(len(c.tokens) for c in choices)
        if stream:
            return Plan(model, True, steps, steps=lambda: shapes.chat_stream_steps(answer))
        return Plan(model, False, steps, body=lambda: shapes.chat_response(answer))

    def _prompts(self, raw: Any) -> list[tuple[list[int], str]]:
        def ids_ok(x: Any) -> bool:
            return isinstance(x, list) and bool(x) and all(isinstance(i, int) and not isinstance(i, bool) for i in x)

        if isinstance(raw, str):
            return [(tok.encode(raw), raw)]
        if ids_ok(raw):
            return [(list(raw), tok.decode(raw))]
        if isinstance(raw, list) and raw and all(isinstance(p, str) for p in raw):
            return [(tok.encode(p), p) for p in raw]
        if isinstance(raw, list) and raw and all(ids_ok(p) for p in raw):
            return [(list(p), tok.decode(p)) for p in raw]
        raise BadRequest("prompt must be a string, a list of strings, or token ids", "prompt")

    def _plan_completions(self, body: dict[str, Any]) -> Plan:
        model = self._model_name(body)
        prompts = self._prompts(body.get("prompt"))
        sampling = _sampling(body, _int(body, "max_tokens", 16, 1, 10_000_000) or 16)
        top = _int(body, "logprobs", None, 0, 20)
        stream = _bool(body, "stream")
        stream_options = body.get("stream_options") or {}
        if not isinstance(stream_options, dict):
            raise BadRequest("stream_options must be an object", "stream_options")
        opts = shapes.Options(
            return_token_ids=_bool(body, "return_token_ids"),
            logprobs=top is not None,
            top_logprobs=top or 0,
            include_usage=stream_options.get("include_usage") is True,
            continuous_usage=stream_options.get("continuous_usage_stats") is True,
            echo=_bool(body, "echo"),
        )
        batches: list[tuple[list[int], list[Choice]]] = []
        cached = 0
        for ids, text in prompts:
            batches.append((ids, self.state.model.generate(ids, sampling, user_text=text)))
            cached += self._cached(model, ids)
        texts = tuple(text for _, text in prompts)
        answer = shapes.Answer(f"cmpl-{uuid.uuid4().hex}", int(time.time()), model, batches, cached, opts, texts)
        steps = max(len(c.tokens) for _, cs in batches for c in cs)
        if stream:
            return Plan(model, True, steps, steps=lambda: shapes.completion_stream_steps(answer))
        return Plan(model, False, steps, body=lambda: shapes.completion_response(answer))

    def _plan_embeddings(self, body: dict[str, Any]) -> Plan:
        model = self._model_name(body)
        raw = body.get("input")
        if raw is None:
            raise BadRequest("input is required", "input")
        try:
            inputs = self._prompts(raw)
        except BadRequest as exc:
            raise BadRequest("input must be a string, a list of strings, or token ids", "input") from exc
        dims = _int(body, "dimensions", self.state.config.embedding_dim, 1, 65_536) or 1
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise BadRequest("encoding_format must be float or base64", "encoding_format")

        def build() -> dict[str, Any]:
            data = []
            for index, (ids, _) in enumerate(inputs):
                vector = _embedding(ids, dims)
                value: Any = vector
                if fmt == "base64":
                    value = base64.b64encode(struct.pack(f"<{dims}f", *vector)).decode("ascii")
                data.append({"object": "embedding", "index": index, "embedding": value})
            n = sum(len(ids) for ids, _ in inputs)
            return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": n, "total_tokens": n}}

        return Plan(model, False, 1, body=build)

    def _plan_responses(self, body: dict[str, Any]) -> Plan:
        model = self._model_name(body)
        stream = _bool(body, "stream")
        messages: list[dict[str, Any]] = []
        if isinstance(body.get("instructions"), str):
            messages.append({"role": "system", "content": body["instructions"]})
        raw = body.get("input")
        if isinstance(raw, str):
            messages.append({"role": "user", "content": raw})
        elif isinstance(raw, list) and raw:
            for i, item in enumerate(raw):
                if not isinstance(item, dict):
                    raise BadRequest(f"input[{i}] must be an object", "input")
                kind = item.get("type", "message")
                if kind == "message" and item.get("role") in tok.ROLES:
                    messages.append({"role": item["role"], "content": item.get("content")})
                elif kind == "function_call":
                    call = {"id": item.get("call_id"), "type": "function", "function": item}
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                elif kind == "function_call_output":
                    messages.append({"role": "tool", "content": str(item.get("output", ""))})
        else:
            raise BadRequest("input must be a string or a non-empty list of items", "input")
        messages = self._messages(messages)
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise BadRequest("tools must be a list", "tools")
        max_output = _int(body, "max_output_tokens", None, 1, 10_000_000)
        sampling = _sampling({**body, "n": 1}, max_output or self.state.config.default_max_tokens)
        tool = None
        if messages[-1]["role"] == "user":
            tool = _tool_spec(tools, body.get("tool_choice", "auto"), flat=True)
        prompt_ids, _ = tok.render_chat(messages, tools)
        user = next((m for m in reversed(messages) if m["role"] == "user"), None)
        user_text = tok.content_text(user.get("content")) if user else ""
        choice = self.state.model.generate(prompt_ids, sampling, user_text=user_text, tool=tool)[0]
        cached = self._cached(model, prompt_ids)
        response_id = f"resp_{uuid.uuid4().hex}"

        def final() -> dict[str, Any]:
            return shapes.responses_object(
                id=response_id,
                created=int(time.time()),
                model=model,
                choice=choice,
                prompt_ids=prompt_ids,
                cached=cached,
                request=body,
                max_output_tokens=max_output,
            )

        if stream:
            return Plan(
                model,
                True,
                len(choice.tokens),
                steps=lambda: shapes.responses_stream_steps(final(), choice),
                named_events=True,
            )
        return Plan(model, False, len(choice.tokens), body=final)


def _embedding(ids: list[int], dims: int) -> list[float]:
    rng = random.Random(prompt_digest(ids))
    vector = [rng.gauss(0.0, 1.0) for _ in range(dims)]
    norm = sum(v * v for v in vector) ** 0.5 or 1.0
    return [round(v / norm, 7) for v in vector]
