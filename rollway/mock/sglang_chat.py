"""Chat bodies and stream chunks as SGLang 0.5.23 serialises them (``serving_chat.py``, ``sse_utils.py``).

Non-streamed, each choice carries ``matched_stop``, ``prompt_token_ids`` and ``response_token_ids`` when
``return_token_ids`` asks (``prompt_token_ids`` alone with ``return_prompt_token_ids``), ``meta_info`` with
``return_meta_info``; the body carries ``metadata`` and, when its ids are asked, ``sglext``. No
``system_fingerprint``.

Streamed, SGLang sends per decode step and choice a content chunk when the step's text is not empty, with that
step's logprobs. A step that adds no text (the end-of-sequence token) sends nothing, and its logprobs are lost --
unless the server runs a tool-call parser: then they come alone, in a chunk whose delta says nothing. Each choice
starts with a role chunk; the finish chunks of all choices come after the last content (in the order the choices
ended), then the ``sglext`` ids chunk, then the usage chunk. Content, role, finish and logprobs chunks are built by
msgspec and leave ``usage`` out; the ids chunk, the usage chunk and the tool-call parser's chunks are pydantic's
(``"usage": null`` included).

A request whose tools the parser reads sends its text through it: tool-call chunks (the call's id and name once the
name is whole, then a piece of the arguments per token), the markup held back, plain text as pydantic chunks.
"""

from __future__ import annotations

import hashlib
from typing import Any

from rollway.mock import tokenizer as tok
from rollway.mock.answer import Answer
from rollway.mock.model import Choice, Token
from rollway.mock.sglang_shapes import Ask, answer_usage, chat_logprobs, ended, metadata, usage, visible


def tool_call_id(choice: Choice) -> str:
    """SGLang's ``call_<24 hex>``, drawn from the fake model's seed (a call repeats with its answer)."""
    return "call_" + hashlib.blake2b(choice.salt.encode(), digest_size=12).hexdigest()


def _parsed(gen: Answer[Ask], choice: Choice) -> bool:
    """The choice's output goes through the tool-call parser (it holds the call's markup)."""
    return gen.opts.parse_tools and tok.TOOL_CALL_START_ID in choice.token_ids


# ---------------------------------------------------------------------------------------------- not streamed


def _message(gen: Answer[Ask], choice: Choice) -> tuple[dict[str, Any], bool]:
    """The message, and whether it holds a parsed tool call. A call cut before its end parses as none, and the
    parser keeps only the text before the markup (none)."""
    message: dict[str, Any] = {"role": "assistant", "content": "", "reasoning_content": None}
    if not _parsed(gen, choice):
        message["content"] = "".join(visible(t) for t in choice.tokens)
        return message, False
    call = choice.parsed_call
    if call is None:
        return message, False
    function = {"name": call.name, "arguments": call.arguments}
    message["tool_calls"] = [{"id": tool_call_id(choice), "index": 0, "type": "function", "function": function}]
    return message, True


def _meta_info(gen: Answer[Ask], choice: Choice) -> dict[str, Any]:
    """The engine's ``meta_info`` (``return_meta_info``), the fields that do not depend on timing."""
    reason, matched = ended(choice)
    finish: dict[str, Any] = {"type": reason, "matched": matched}
    if reason == "length":
        finish = {"type": reason, "length": len(choice.tokens)}
    out: dict[str, Any] = {
        "id": gen.id,
        "finish_reason": finish,
        "prompt_tokens": len(gen.prompt_ids),
        "weight_version": "default",
        "num_retractions": 0,
    }
    if gen.opts.logprobs:
        out["input_token_logprobs"] = []
        out["output_token_logprobs"] = [[choice.logprob(p, 0)[0], t.id, t.text] for p, t in enumerate(choice.tokens)]
        out["output_token_logprobs_length"] = len(choice.tokens)
    out |= {
        "reasoning_tokens": 0,
        "completion_tokens": len(choice.tokens),
        "cached_tokens": gen.cached,
        "weight_versions": metadata(len(choice.tokens))["weight_versions"],
        "cached_tokens_details": {"device": gen.cached, "host": 0},
        "dp_rank": None,
        "e2e_latency": 0.001,
        "response_sent_to_client_ts": float(gen.created),
    }
    return out


def _sglext(gen: Answer[Ask]) -> dict[str, Any] | None:
    ask = gen.opts
    out: dict[str, Any] = {}
    if ask.input_ids:
        out["input_ids"] = gen.prompt_ids
    if ask.output_ids:
        out["output_ids"] = [c.token_ids for c in gen.choices]
    return out or None


def chat_response(gen: Answer[Ask]) -> dict[str, Any]:
    ask, out = gen.opts, []
    for choice in gen.choices:
        message, called = _message(gen, choice)
        reason, matched = ended(choice)
        if called and reason == "stop":
            reason, matched = "tool_calls", None
        entry: dict[str, Any] = {
            "index": choice.index,
            "message": message,
            "logprobs": chat_logprobs(choice, range(len(choice.tokens)), ask.top_logprobs) if ask.logprobs else None,
            "finish_reason": reason,
            "matched_stop": matched,
        }
        if ask.return_token_ids or ask.return_prompt_token_ids:
            entry["prompt_token_ids"] = gen.prompt_ids
        if ask.return_token_ids:
            entry["response_token_ids"] = choice.token_ids
        if ask.return_meta_info:
            entry["meta_info"] = _meta_info(gen, choice)
        out.append(entry)
    body: dict[str, Any] = {
        **gen.head("chat.completion"),
        "choices": out,
        "usage": answer_usage(gen),
        "metadata": metadata(len(gen.choices[0].tokens)),
    }
    ext = _sglext(gen)
    if ext is not None:
        body["sglext"] = ext
    return body


# -------------------------------------------------------------------------------------------------- streamed


class _Chunks:
    """The two kinds of chunk a SGLang stream holds, for one answer."""

    def __init__(self, gen: Answer[Ask]) -> None:
        self.head = gen.head("chat.completion.chunk")

    def plain(self, index: int, usage: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
        """msgspec's ``StreamChunk``: the delta's unset ``role`` and ``content`` and the chunk's ``usage`` left out."""
        delta: dict[str, Any] = {"reasoning_content": None}
        delta |= {k: fields[k] for k in ("role", "content") if fields.get(k) is not None}
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": fields.get("logprobs"),
            "finish_reason": fields.get("finish_reason"),
            "matched_stop": fields.get("matched_stop"),
        }
        chunk: dict[str, Any] = {**self.head, "choices": [choice]}
        if usage is not None:
            chunk["usage"] = usage
        return chunk

    def model(self, index: int, usage: dict[str, Any] | None, **delta: Any) -> dict[str, Any]:
        """pydantic's ``ChatCompletionStreamResponse`` (every field, ``tool_calls`` only when set)."""
        fields: dict[str, Any] = {"role": None, "content": delta.get("content"), "reasoning_content": None}
        if delta.get("tool_calls") is not None:
            fields["tool_calls"] = delta["tool_calls"]
        choice = {"index": index, "delta": fields, "logprobs": None, "finish_reason": None, "matched_stop": None}
        return {**self.head, "choices": [choice], "usage": usage}

    def extra(self, **fields: Any) -> dict[str, Any]:
        """A chunk of the whole answer (``choices: []``): the ids or the usage."""
        return {**self.head, "choices": [], "usage": fields.get("usage"), **fields}


def _parser_chunks(chunks: _Chunks, choice: Choice, token: Token, running: dict[str, Any] | None) -> list[Any]:
    """What the tool-call parser makes of one token: the call opened once its name is whole, a piece of its
    arguments, plain text; the markup and the end-of-sequence token make nothing."""
    call = choice.tool_call
    if token.opens_tool_call and call is not None:
        opened = {"id": tool_call_id(choice), "index": 0, "type": "function"}
        opened["function"] = {"name": call.name, "arguments": ""}
        return [chunks.model(choice.index, running, tool_calls=[opened])]
    if token.arguments:
        piece = {"id": None, "index": 0, "type": "function", "function": {"name": None, "arguments": token.arguments}}
        return [chunks.model(choice.index, running, tool_calls=[piece])]
    if token.content:
        return [chunks.model(choice.index, running, content=token.content)]
    return []


def _step(gen: Answer[Ask], chunks: _Chunks, choice: Choice, position: int) -> list[dict[str, Any]]:
    """The chunks one decode step of one choice sends."""
    ask, token = gen.opts, choice.tokens[position]
    running = usage(len(gen.prompt_ids), position + 1) if ask.continuous_usage else None
    logprobs = chat_logprobs(choice, range(position, position + 1), ask.top_logprobs) if ask.logprobs else None
    out: list[dict[str, Any]] = []
    if position == 0:
        out.append(chunks.plain(choice.index, role="assistant", content=""))
    if ask.parse_tools:
        out.extend(_parser_chunks(chunks, choice, token, running))
    elif visible(token):
        return [*out, chunks.plain(choice.index, running, content=visible(token), logprobs=logprobs)]
    if logprobs is not None and ask.parser:  # the parser's flush: the step's logprobs on their own
        out.append(chunks.plain(choice.index, running, logprobs=logprobs))
    return out


def chat_stream_steps(gen: Answer[Ask]) -> list[list[dict[str, Any]]]:
    """Chunks grouped by decode step; the last step also holds the finish, ids and usage chunks."""
    chunks, ask = _Chunks(gen), gen.opts
    longest = max(len(c.tokens) for c in gen.choices)
    steps: list[list[dict[str, Any]]] = [[] for _ in range(longest)]
    for position in range(longest):
        for choice in gen.choices:
            if position < len(choice.tokens):
                steps[position].extend(_step(gen, chunks, choice, position))
    tail = steps[-1]
    for choice in sorted(gen.choices, key=lambda c: (len(c.tokens), c.index)):
        reason, matched = ended(choice)
        if reason == "stop" and ask.parse_tools and choice.tool_call is not None:
            reason = "tool_calls"  # (``matched_stop`` stays the end-of-sequence token's, unlike a whole answer's)
        tail.append(chunks.plain(choice.index, finish_reason=reason, matched_stop=matched))
    ext = _sglext(gen)
    if ext is not None:
        tail.append(chunks.extra(sglext=ext))
    if ask.include_usage:
        tail.append(chunks.extra(usage=answer_usage(gen)))
    return steps
