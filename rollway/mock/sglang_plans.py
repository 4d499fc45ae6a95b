"""Plans of the ``sglang`` flavour: SGLang 0.5.23's routes and answer shapes over the same fake model as the vLLM
flavour (the same prompt gives the same tokens), with SGLang's checks where they differ from vLLM's.

SGLang's own checks: an empty ``messages`` (``Messages cannot be empty.``), a ``tool_choice`` without its tools,
and ``return_token_ids``, ``return_prompt_token_ids`` or ``return_meta_info`` on a streamed chat (400; the ids of a
stream come in its ``sglext`` chunk). It ignores fields it does not know, answers with the request's ``rid`` as the
id, and has no ``/version``. The other checks are the vLLM flavour's, in SGLang's error envelope.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from rollway.mock import sglang_chat, sglang_completions, sglang_info, sglang_responses
from rollway.mock import validation as check
from rollway.mock.answer import Answer
from rollway.mock.identity import sglang_id
from rollway.mock.plans import Plan, Planner
from rollway.mock.response_items import LOGPROBS_INCLUDE, ResponseAnswer
from rollway.mock.sglang_shapes import Ask, error_body
from rollway.mock.validation import BadRequest

#: What SGLang refuses on a streamed chat, and its messages.
STREAM_REFUSED = {
    "return_prompt_token_ids": "return_prompt_token_ids is not supported with streaming. Please set stream=false "
    "when using return_prompt_token_ids=true.",
    "return_token_ids": "return_token_ids is not supported with streaming on /v1/chat/completions. Please set "
    "stream=false when using return_token_ids=true.",
    "return_meta_info": "return_meta_info is not supported with streaming. Please set stream=false when using "
    "return_meta_info=true.",
}


def _sglext_asked(body: dict[str, Any], headers: Mapping[str, str], part: str) -> bool:
    """``return_<part>_ids_in_sglext``, in the body or as an ``x-sglext-return-<part>-ids: 1`` header."""
    return check.boolean(body, f"return_{part}_ids_in_sglext") or headers.get(f"x-sglext-return-{part}-ids") == "1"


def _answer_id(body: dict[str, Any]) -> str:
    rid = body.get("rid")
    return rid if isinstance(rid, str) and rid else sglang_id()


def _tool_choice(body: dict[str, Any]) -> None:
    """SGLang's checks of ``tool_choice`` against the tools."""
    tools, choice = check.sequence(body, "tools") or [], body.get("tool_choice")
    if choice == "required" and not tools:
        raise BadRequest("Tools cannot be empty if tool choice is set to required.")
    if isinstance(choice, dict):
        if not tools:
            raise BadRequest("Tools cannot be empty if tool choice is set to a specific tool.")
        name = (choice.get("function") or {}).get("name")
        if not any(isinstance(t, dict) and (t.get("function") or {}).get("name") == name for t in tools):
            raise BadRequest(f"Tool '{name}' not found in tools list.")


class SGLangPlanner(Planner):
    """Plans the answers of one route of the ``sglang`` flavour (``kind``: chat, completions, responses, models,
    model_card, model_info, get_model_info, server_info, get_server_info, root, health)."""

    def plan(
        self,
        body: dict[str, Any],
        request_id: str | None = None,
        headers: Mapping[str, str] | None = None,
        params: Mapping[str, str] | None = None,
    ) -> Plan:
        config, kind = self.state.config, self.kind
        if kind == "chat":
            return self._sglang_chat(body, headers or {})
        if kind == "completions":
            return self._sglang_completions(body)
        if kind == "responses":
            return self._sglang_responses(body)
        if kind == "models":
            return Plan("", False, 0, body=lambda: sglang_info.models(config))
        if kind == "model_card":
            name = (params or {}).get("model", "")
            if name not in config.models:
                return Plan("", False, 0, body=lambda: sglang_info.unknown_model(name), status=404)
            return Plan("", False, 0, body=lambda: sglang_info.model_card(config, name))
        if kind in ("model_info", "get_model_info"):
            return Plan("", False, 0, body=lambda: sglang_info.model_info(config))
        if kind in ("server_info", "get_server_info"):
            return Plan("", False, 0, body=lambda: sglang_info.server_info(config))
        if kind == "root":
            return Plan("", False, 0, body=lambda: "SGLang is running")
        return Plan("", False, 0, body=lambda: None)  # /health, /health_generate, /ready, /ping: 200, no body

    def error(self, exc: BadRequest) -> dict[str, Any]:
        """SGLang's ``ErrorResponse``; the Responses API's are OpenAI's envelope."""
        if self.kind == "responses":
            return exc.body()
        return error_body(exc.message, exc.type, exc.status)

    def _ask(self, body: dict[str, Any], **asked: Any) -> Ask:
        config = self.state.config
        options = check.mapping(body, "stream_options")
        return Ask(
            include_usage=options.get("include_usage") is True,
            continuous_usage=options.get("continuous_usage_stats") is True,
            parser=bool(config.tool_call_parser),
            cache_report=config.prompt_tokens_details,
            **asked,
        )

    # -- chat ---------------------------------------------------------------------------------------------

    def _sglang_chat(self, body: dict[str, Any], headers: Mapping[str, str]) -> Plan:
        model = self._model_name(body)
        if body.get("messages") == []:
            raise BadRequest("Messages cannot be empty.")
        messages = self._messages(body)
        _tool_choice(body)
        config = self.state.config
        max_tokens = self._limit(body, ("max_completion_tokens", "max_tokens"), config.default_max_tokens)
        stream = check.boolean(body, "stream")
        if stream:
            for key, message in STREAM_REFUSED.items():
                if check.boolean(body, key):
                    raise BadRequest(message, type_="BadRequest")
        tool, _ = self._tool(body, messages, flat=False)
        ask = self._ask(
            body,
            return_token_ids=check.boolean(body, "return_token_ids"),
            return_prompt_token_ids=check.boolean(body, "return_prompt_token_ids"),
            return_meta_info=check.boolean(body, "return_meta_info"),
            input_ids=_sglext_asked(body, headers, "input"),
            output_ids=_sglext_asked(body, headers, "output"),
            framed=headers.get("x-sglext-ids-framed") == "1",
            logprobs=check.boolean(body, "logprobs"),
            top_logprobs=check.logprobs_count(check.integer(body, "top_logprobs") or 0),
            parse_tools=bool(config.tool_call_parser and body.get("tools") and body.get("tool_choice") != "none"),
        )
        reply = self._reply(model, body, messages, max_tokens, tool)
        batches = [(reply.prompt_ids, reply.choices)]
        gen = Answer(_answer_id(body), int(time.time()), model, batches, reply.cached, ask)
        steps = max(len(c.tokens) for c in reply.choices)
        if not stream:
            return Plan(model, False, steps, body=lambda: sglang_chat.chat_response(gen))

        def framed(chunk: dict[str, Any]) -> str | None:
            return "sglext_ids" if "sglext" in chunk else None

        event_name = framed if ask.framed else None
        return Plan(model, True, steps, steps=lambda: sglang_chat.chat_stream_steps(gen), event_name=event_name)

    # -- completions --------------------------------------------------------------------------------------

    def _sglang_completions(self, body: dict[str, Any]) -> Plan:
        model = self._model_name(body)
        if body.get("prompt") is None:
            raise check.missing(body, "prompt")
        prompts = self._prompts(body, "prompt")
        max_tokens = self._limit(body, ("max_tokens",), 16)
        top = check.integer(body, "logprobs")
        stream = check.boolean(body, "stream")
        ask = self._ask(
            body,
            return_token_ids=check.boolean(body, "return_token_ids"),
            logprobs=top is not None,
            top_logprobs=check.logprobs_count(top or 0),
            echo=check.boolean(body, "echo"),
        )
        batches, cached, _ = self._complete(model, body, prompts, max_tokens)
        texts = tuple(text for _, text in prompts)
        gen = Answer(_answer_id(body), int(time.time()), model, batches, cached, ask, texts)
        steps = max(len(c.tokens) for _, cs in batches for c in cs)
        if stream:
            return Plan(model, True, steps, steps=lambda: sglang_completions.completion_stream_steps(gen))
        return Plan(model, False, steps, body=lambda: sglang_completions.completion_response(gen))

    # -- responses ----------------------------------------------------------------------------------------

    def _sglang_responses(self, body: dict[str, Any]) -> Plan:
        model = self._model_name(body)
        stream = check.boolean(body, "stream")
        messages = self._response_messages(body)
        logprobs = LOGPROBS_INCLUDE in (check.sequence(body, "include") or [])
        if stream and logprobs:
            raise BadRequest("logprobs are not supported in streaming mode", "logprobs", type_="invalid_request_error")
        asked = check.integer(body, "max_output_tokens")
        limit = max(asked - sglang_responses.HEADROOM, 1) if asked is not None else self.state.config.default_max_tokens
        reply = self._response_reply(model, body, messages, limit)
        choice = reply.choices[0]
        answer = ResponseAnswer(
            id=f"resp_{sglang_id()}",
            created=int(time.time()),
            model=model,
            choice=choice,
            prompt_ids=reply.prompt_ids,
            cached=reply.cached,
            request=body,
            item_key=sglang_id(),
            logprobs=logprobs,
            top_logprobs=check.logprobs_count(check.integer(body, "top_logprobs") or 0),
        )
        steps = len(choice.tokens)
        if stream:
            events = sglang_responses.response_stream_steps
            return Plan(model, True, steps, steps=lambda: events(answer), named_events=True)
        return Plan(model, False, steps, body=lambda: sglang_responses.response_body(answer))
