"""Response bodies and stream chunks in OpenAI's shapes, with vLLM's extensions.

vLLM (>= 0.10.2) with ``return_token_ids: true``:

* chat, non-streamed: top-level ``prompt_token_ids``; ``choices[i].token_ids``.
* chat, streamed: the first chunk of each choice (``delta.role``) carries top-level ``prompt_token_ids``; every
  later chunk carries ``choices[0].token_ids`` for its delta.
* completions, non-streamed: ``choices[i].prompt_token_ids`` and ``choices[i].token_ids`` (per choice).
* completions, streamed: each choice's first chunk carries ``choices[0].prompt_token_ids``, every chunk
  ``choices[0].token_ids``.
* completions with ``echo``: the text starts with the prompt's (each choice's first chunk, streamed) -- but not
  with ``return_token_ids``, which leaves the prompt's text out; with ``logprobs``, the logprobs cover the prompt
  (the first token's null) and then the generated tokens, while ``token_ids`` holds the generated ones only, and
  the choice's ``prompt_logprobs`` are set (vLLM computes the prompt's logprobs for an echo with logprobs).
* chat, streamed: a token whose delta says nothing (a tool call's markup, its name before it is whole) sends no
  chunk, unless the request asked for token ids (``return_token_ids``; ``logprobs`` alone do not), which that
  chunk carries then (with ``delta: {}``, and its logprobs when asked).

Without it those keys are ``null`` (non-streamed bodies, chat role chunks, completion chunks) as vLLM's
serialisation leaves them. The last token chunk of a choice carries ``finish_reason`` (and ``stop_reason``); a
choice that stopped ends with the end-of-sequence token, whose delta adds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollway.mock import tokenizer as tok
from rollway.mock.model import Choice, Token, prompt_digest
from rollway.mock.tokenizer import SPECIAL_BY_ID


@dataclass(frozen=True, slots=True)
class Options:
    """What the request asked to see."""

    return_token_ids: bool = False
    #: Chat: ``logprobs: true``; completions: ``logprobs`` is an integer.
    logprobs: bool = False
    top_logprobs: int = 0
    include_usage: bool = False
    continuous_usage: bool = False
    echo: bool = False


@dataclass(frozen=True, slots=True)
class Answer:
    """A generated answer to render: per prompt, its token ids and choices (chat has exactly one prompt)."""

    id: str
    created: int
    model: str
    batches: list[tuple[list[int], list[Choice]]]
    cached: int
    opts: Options
    #: Each prompt's text (completions), what ``echo`` repeats.
    prompt_texts: tuple[str, ...] = ()

    @property
    def prompt_ids(self) -> list[int]:
        return self.batches[0][0]

    @property
    def choices(self) -> list[Choice]:
        return self.batches[0][1]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprob(choice: Choice, position: int, top: int) -> dict[str, Any]:
    value, alternatives = choice.logprob(position, top)
    entry = _entry(choice.tokens[position].text, value)
    entry["top_logprobs"] = [_entry(t, lp) for t, lp in alternatives]
    return entry


def completion_logprobs(choice: Choice, start: int, stop: int, top: int, offset: int) -> dict[str, Any]:
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []
    for position in range(start, stop):
        value, alternatives = choice.logprob(position, top + 1)
        text = choice.tokens[position].text
        tokens.append(text)
        token_logprobs.append(value)
        top_logprobs.append(dict(alternatives))
        text_offset.append(offset)
        offset += len(text)
    return {
        "text_offset": text_offset,
        "token_logprobs": token_logprobs,
        "tokens": tokens,
        "top_logprobs": top_logprobs,
    }


def _delta(token: Token, call_id: str, name: str) -> dict[str, Any]:
    if token.content is not None:
        return {"content": token.content}
    if token.opens_tool_call:
        return {
            "tool_calls": [{"index": 0, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}]
        }
    if token.arguments is not None:
        return {"tool_calls": [{"index": 0, "function": {"arguments": token.arguments}}]}
    return {}


# ---------------------------------------------------------------------------------------------------- chat


def chat_message(choice: Choice) -> dict[str, Any]:
    call = choice.tool_call
    content = choice.content
    return {
        "role": "assistant",
        "content": None if call is not None and not content else content,
        "tool_calls": []
        if call is None
        else [{"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}],
        "reasoning_content": None,
    }


def chat_response(answer: Answer) -> dict[str, Any]:
    choices, prompt_ids, cached, opts = answer.choices, answer.prompt_ids, answer.cached, answer.opts
    out = []
    for choice in choices:
        logprobs = None
        if opts.logprobs:
            logprobs = {"content": [chat_logprob(choice, p, opts.top_logprobs) for p in range(len(choice.tokens))]}
        out.append(
            {
                "index": choice.index,
                "message": chat_message(choice),
                "logprobs": logprobs,
                "finish_reason": choice.finish_reason,
                "stop_reason": None,
                "token_ids": choice.token_ids if opts.return_token_ids else None,
            }
        )
    return {
        "id": answer.id,
        "object": "chat.completion",
        "created": answer.created,
        "model": answer.model,
        "choices": out,
        "usage": usage(len(prompt_ids), sum(len(c.tokens) for c in choices), cached),
        "prompt_logprobs": None,
        "prompt_token_ids": prompt_ids if opts.return_token_ids else None,
        "kv_transfer_params": None,
    }


def chat_stream_steps(answer: Answer) -> list[list[dict[str, Any]]]:
    """Chunks grouped by decode step: step 0 has each choice's role chunk and first token; step k token k."""
    choices, prompt_ids, cached, opts = answer.choices, answer.prompt_ids, answer.cached, answer.opts
    head = {"id": answer.id, "object": "chat.completion.chunk", "created": answer.created, "model": answer.model}
    steps: list[list[dict[str, Any]]] = [[]]
    n_prompt = len(prompt_ids)
    for choice in choices:
        first = {
            **head,
            "choices": [
                {
                    "index": choice.index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
            "prompt_token_ids": prompt_ids if opts.return_token_ids else None,
        }
        if opts.continuous_usage:
            first["usage"] = usage(n_prompt, 0, cached)
        steps[0].append(first)
    longest = max((len(c.tokens) for c in choices), default=0)
    for position in range(longest):
        if position >= len(steps):
            steps.append([])
        for choice in choices:
            if position >= len(choice.tokens):
                continue
            token = choice.tokens[position]
            last = position == len(choice.tokens) - 1
            call = choice.tool_call
            entry: dict[str, Any] = {
                "index": choice.index,
                "delta": _delta(token, call.id if call else "", call.name if call else ""),
                "logprobs": {"content": [chat_logprob(choice, position, opts.top_logprobs)]} if opts.logprobs else None,
                "finish_reason": choice.finish_reason if last else None,
            }
            if not last and not entry["delta"] and not opts.return_token_ids:
                continue  # nothing to say, no token ids asked for: no chunk (logprobs alone do not send it)
            if last:
                entry["stop_reason"] = None
            entry["token_ids"] = [token.id] if opts.return_token_ids else None
            chunk = {**head, "choices": [entry]}
            if opts.continuous_usage:
                chunk["usage"] = usage(n_prompt, position + 1, cached)
            steps[position].append(chunk)
    if opts.include_usage:
        steps[-1].append({**head, "choices": [], "usage": usage(n_prompt, sum(len(c.tokens) for c in choices), cached)})
    return steps


# ----------------------------------------------------------------------------------------------- completions


def completion_response(answer: Answer) -> dict[str, Any]:
    batches, cached, opts = answer.batches, answer.cached, answer.opts
    out: list[dict[str, Any]] = []
    n_prompt = n_completion = 0
    for number, (prompt_ids, choices) in enumerate(batches):
        n_prompt += len(prompt_ids)
        echoed, prompt_logprobs = _echo(answer, number)
        for choice in choices:
            n_completion += len(choice.tokens)
            logprobs = None
            if opts.logprobs:
                logprobs = _echoed_logprobs(answer, number, choice, len(choice.tokens))
            out.append(
                {
                    "index": len(out),
                    "text": echoed + choice.text,
                    "logprobs": logprobs,
                    "finish_reason": choice.finish_reason,
                    "stop_reason": None,
                    "prompt_logprobs": prompt_logprobs,
                    "prompt_token_ids": prompt_ids if opts.return_token_ids else None,
                    "token_ids": choice.token_ids if opts.return_token_ids else None,
                }
            )
    return {
        "id": answer.id,
        "object": "text_completion",
        "created": answer.created,
        "model": answer.model,
        "choices": out,
        "usage": usage(n_prompt, n_completion, cached),
        "kv_transfer_params": None,
    }


def completion_stream_steps(answer: Answer) -> list[list[dict[str, Any]]]:
    batches, cached, opts = answer.batches, answer.cached, answer.opts
    head = {"id": answer.id, "object": "text_completion", "created": answer.created, "model": answer.model}
    flat = [(number, prompt_ids, choice) for number, (prompt_ids, choices) in enumerate(batches) for choice in choices]
    steps: list[list[dict[str, Any]]] = [[]]
    offsets = [0] * len(flat)
    longest = max((len(c.tokens) for _, _, c in flat), default=0)
    n_prompt = sum(len(p) for p, _ in batches)
    for position in range(longest):
        if position >= len(steps):
            steps.append([])
        for index, (number, prompt_ids, choice) in enumerate(flat):
            if position >= len(choice.tokens):
                continue
            token = choice.tokens[position]
            last = position == len(choice.tokens) - 1
            echoed = _echo(answer, number)[0] if position == 0 else ""
            logprobs = None
            if opts.logprobs and position == 0:
                logprobs = _echoed_logprobs(answer, number, choice, 1)
            elif opts.logprobs:
                logprobs = completion_logprobs(choice, position, position + 1, opts.top_logprobs, offsets[index])
            text = echoed + ("" if token.id in SPECIAL_BY_ID else token.text)
            offsets[index] += len(echoed) + len(token.text)
            chunk = {
                **head,
                "choices": [
                    {
                        "index": index,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": choice.finish_reason if last else None,
                        "stop_reason": None,
                        "prompt_token_ids": prompt_ids if opts.return_token_ids and position == 0 else None,
                        "token_ids": [token.id] if opts.return_token_ids else None,
                    }
                ],
                "usage": usage(n_prompt, position + 1, cached) if opts.continuous_usage else None,
            }
            steps[position].append(chunk)
    if opts.include_usage:
        total = sum(len(c.tokens) for _, _, c in flat)
        steps[-1].append({**head, "choices": [], "usage": usage(n_prompt, total, cached)})
    return steps


def _echo(answer: Answer, number: int) -> tuple[str, list[dict[str, Any] | None] | None]:
    """What an ``echo`` puts before prompt ``number``'s completions (nothing with ``return_token_ids``), and the
    choices' ``prompt_logprobs`` (set when it asked for logprobs too)."""
    opts = answer.opts
    if not opts.echo:
        return "", None
    text = "" if opts.return_token_ids else answer.prompt_texts[number]
    if not opts.logprobs:
        return text, None
    prompt = _prompt_logprobs(answer.batches[number][0], 0)
    entries = zip(prompt["tokens"], prompt["token_logprobs"], answer.batches[number][0], strict=True)
    scored = [{str(i): {"logprob": lp, "rank": 1, "decoded_token": t}} for t, lp, i in entries]
    return text, [None, *scored[1:]]


def _prompt_logprobs(prompt_ids: list[int], top: int) -> dict[str, Any]:
    """The prompt's tokens as completion logprobs (the first token has no logprob: nothing came before it)."""
    tokens = [Token(id=i, text=tok.decode([i])) for i in prompt_ids]
    out = completion_logprobs(Choice(0, tokens, "", prompt_digest(prompt_ids)), 0, len(tokens), top, 0)
    out["token_logprobs"][0] = out["top_logprobs"][0] = None
    return out


def _echoed_logprobs(answer: Answer, number: int, choice: Choice, stop: int) -> dict[str, Any]:
    """The logprobs of ``choice``'s first ``stop`` tokens, after the prompt's when the request has ``echo``."""
    top = answer.opts.top_logprobs
    if not answer.opts.echo:
        return completion_logprobs(choice, 0, stop, top, 0)
    prompt = _prompt_logprobs(answer.batches[number][0], top)
    generated = completion_logprobs(choice, 0, stop, top, sum(len(t) for t in prompt["tokens"]))
    return {key: prompt[key] + generated[key] for key in prompt}


# ------------------------------------------------------------------------------------------------- responses


def responses_object(
    *,
    id: str,
    created: int,
    model: str,
    choice: Choice,
    prompt_ids: list[int],
    cached: int,
    request: dict[str, Any],
    max_output_tokens: int | None,
) -> dict[str, Any]:
    output: list[dict[str, Any]] = []
    call = choice.tool_call
    if call is not None:
        output.append(
            {
                "type": "function_call",
                "id": "fc_" + call.id.removeprefix("call_"),
                "call_id": call.id,
                "name": call.name,
                "arguments": call.arguments,
                "status": "completed",
            }
        )
    else:
        output.append(
            {
                "type": "message",
                "id": "msg_" + id.removeprefix("resp_"),
                "status": "completed" if choice.finish_reason != "length" else "incomplete",
                "role": "assistant",
                "content": [{"type": "output_text", "text": choice.content, "annotations": [], "logprobs": []}],
            }
        )
    incomplete = choice.finish_reason == "length"
    return {
        "id": id,
        "object": "response",
        "created_at": created,
        "status": "incomplete" if incomplete else "completed",
        "model": model,
        "output": output,
        "usage": {
            "input_tokens": len(prompt_ids),
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": len(choice.tokens),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": len(prompt_ids) + len(choice.tokens),
        },
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": request.get("instructions"),
        "max_output_tokens": max_output_tokens,
        "metadata": request.get("metadata") or {},
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "previous_response_id": request.get("previous_response_id"),
        "temperature": request.get("temperature"),
        "top_p": request.get("top_p"),
        "tool_choice": request.get("tool_choice", "auto"),
        "tools": request.get("tools") or [],
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "store": False,
        "user": request.get("user"),
    }


def responses_stream_steps(final: dict[str, Any], choice: Choice) -> list[list[dict[str, Any]]]:
    """The Responses API's stream of ``final`` (``responses_object``), by decode step: ``response.created``,
    ``response.in_progress``, the output item (and its text part) opened, then one delta per token, then the
    item closed and ``response.completed`` (``response.incomplete`` at the token limit) carrying ``final``.
    Each event has its ``type`` and a rising ``sequence_number``; the stream has no ``[DONE]``."""
    numbers = iter(range(1 << 30))

    def event(type_: str, **fields: Any) -> dict[str, Any]:
        return {"type": type_, "sequence_number": next(numbers), **fields}

    pending = {**final, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    head = [event("response.created", response=pending), event("response.in_progress", response=pending)]
    item = final["output"][0]
    where = {"item_id": item["id"], "output_index": 0}
    if item["type"] == "function_call":
        head.append(event("response.output_item.added", output_index=0, item={**item, "arguments": ""}))
        deltas = [
            event("response.function_call_arguments.delta", **where, delta=t.arguments)
            for t in choice.tokens
            if t.arguments
        ]
        tail = [event("response.function_call_arguments.done", **where, arguments=item["arguments"])]
    else:
        part = item["content"][0]
        opened = {**item, "status": "in_progress", "content": []}
        head.append(event("response.output_item.added", output_index=0, item=opened))
        head.append(event("response.content_part.added", **where, content_index=0, part={**part, "text": ""}))
        deltas = [
            event("response.output_text.delta", **where, content_index=0, delta=t.content, logprobs=[])
            for t in choice.tokens
            if t.content
        ]
        tail = [
            event("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[]),
            event("response.content_part.done", **where, content_index=0, part=part),
        ]
    tail.append(event("response.output_item.done", output_index=0, item=item))
    ended = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
    tail.append(event(ended, response=final))
    steps = [[*head, *deltas[:1]], *([d] for d in deltas[1:])]
    steps[-1].extend(tail)
    return steps
