"""Chat bodies and stream chunks as vLLM 0.32 serialises them, and what its chat and completions share (what the
request asked for, usage, logprob entries).

Non-streamed bodies carry every field of vLLM's models, unset ones as ``null``; stream chunks carry only the fields
vLLM sets (it serialises them with ``exclude_unset``), and the usage chunk drops its nulls (``exclude_none``).
vLLM's extensions with ``return_token_ids: true``:

* chat, non-streamed: top-level ``prompt_token_ids``; ``choices[i].token_ids``.
* chat, streamed: the role chunk of each choice carries top-level ``prompt_token_ids``; every later chunk
  carries ``choices[0].token_ids`` for its delta.

Streamed chat sends a chunk per generated token. A token whose delta says nothing (tool-call markup the parser
holds back, the end-of-sequence token) still sends one, with ``delta: {}``, when the request asked for
``logprobs`` or ``return_token_ids`` (the chunk carries them), and always when it is the choice's last (it
carries ``finish_reason`` and ``stop_reason``); otherwise it sends none. ``system_fingerprint`` is on
non-streamed bodies and, in streams, on each choice's last chunk -- or only on the usage chunk when
``stream_options.include_usage`` asks for one. ``usage.prompt_tokens_details`` is null unless the mock plays a
vLLM started with ``--enable-prompt-tokens-details`` (``MockConfig.prompt_tokens_details``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from rollway.mock.answer import VLLM_CHAT_KEYS, Answer, Asked, logprob_entry, token_counts
from rollway.mock.model import Choice, Token

ToolMode = Literal["auto", "named", "required"]


@dataclass(frozen=True, slots=True)
class Options(Asked):
    """What the request asked to see, and how the mock's vLLM is set up."""

    #: How a tool call was asked for: ``auto`` (the parser finds it), ``named`` or ``required``.
    tool_mode: ToolMode = "auto"
    fingerprint: str = ""
    #: The server reports ``usage.prompt_tokens_details`` (vLLM's ``--enable-prompt-tokens-details``).
    prompt_details: bool = False
    #: Completions' ``prompt_logprobs``: the prompt's tokens scored, with this many likeliest others.
    prompt_logprobs: int | None = None
    #: The weights loaded (``FakeModel.weights``), which the prompt's scores depend on.
    weights: str = ""


# ---------------------------------------------------------------------------------------------------- usage


def usage(prompt_tokens: int, completion_tokens: int, details: dict[str, Any] | None = None) -> dict[str, Any]:
    """A non-streamed body's ``usage``."""
    counts = token_counts(prompt_tokens, completion_tokens)
    return {**counts, "prompt_tokens_details": details, "completion_tokens_details": None}


def final_usage(prompt_tokens: int, completion_tokens: int, details: dict[str, Any] | None = None) -> dict[str, Any]:
    """The usage chunk's ``usage``: nulls left out."""
    out = token_counts(prompt_tokens, completion_tokens)
    if details is not None:
        out["prompt_tokens_details"] = {k: v for k, v in details.items() if v is not None}
    return out


def running_usage(prompt_tokens: int, completion_tokens: int, *, chat: bool) -> dict[str, Any]:
    """A chunk's ``usage`` with ``continuous_usage_stats`` (chat's names ``completion_tokens_details``, null)."""
    out = token_counts(prompt_tokens, completion_tokens)
    if chat:
        out["completion_tokens_details"] = None
    return out


def prompt_details(answer: Answer[Options], *, chat: bool) -> dict[str, Any] | None:
    """``usage.prompt_tokens_details`` (chat also counts the prompt tokens written to the cache)."""
    if not answer.opts.prompt_details:
        return None
    created = answer.created_cache if chat else None
    return {"cached_tokens": answer.cached, "created_cache_tokens": created, "multimodal_tokens": None}


# ------------------------------------------------------------------------------------------------- logprobs


def chat_logprob(choice: Choice, position: int, top: int) -> dict[str, Any]:
    return logprob_entry(choice, position, top, VLLM_CHAT_KEYS)


def completion_logprobs(choice: Choice, start: int, stop: int, top: int, offset: int) -> dict[str, Any]:
    """Completions' logprobs of tokens ``start:stop``. Each ``top_logprobs`` dict holds the ``top`` likeliest
    tokens, the sampled one always among them (the fake model's sampled token is its likeliest)."""
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []
    for position in range(start, stop):
        value, alternatives = choice.logprob(position, max(top, 1))
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


# ---------------------------------------------------------------------------------------------------- chat


def finish_reason(choice: Choice, opts: Options) -> str:
    """vLLM's: ``tool_calls`` for a call found by the parser or asked as ``required``, ``stop`` for a named one."""
    if choice.finish_reason == "tool_calls" and opts.tool_mode == "named":
        return "stop"
    return choice.finish_reason


def chat_message(choice: Choice, opts: Options) -> dict[str, Any]:
    """The whole message: a cut tool call parses as none, and the content is then the raw output."""
    call = choice.parsed_call
    content: str | None = choice.content
    if call is not None and not content:
        content = None if opts.tool_mode == "auto" else ""
    elif choice.unparsed:
        content = choice.raw_text
    message: dict[str, Any] = {
        "role": "assistant",
        "content": content,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
    }
    if call is not None:  # vLLM leaves an empty ``tool_calls`` out
        message["tool_calls"] = [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        ]
    message["reasoning"] = None
    return message


def chat_response(answer: Answer[Options]) -> dict[str, Any]:
    choices, prompt_ids, opts = answer.choices, answer.prompt_ids, answer.opts
    out = []
    for choice in choices:
        logprobs = None
        if opts.logprobs:
            logprobs = {"content": [chat_logprob(choice, p, opts.top_logprobs) for p in range(len(choice.tokens))]}
        out.append(
            {
                "index": choice.index,
                "message": chat_message(choice, opts),
                "logprobs": logprobs,
                "finish_reason": finish_reason(choice, opts),
                "stop_reason": None,
                "token_ids": choice.token_ids if opts.return_token_ids else None,
                "routed_experts": None,
            }
        )
    return {
        **answer.head("chat.completion"),
        "choices": out,
        "service_tier": None,
        "system_fingerprint": opts.fingerprint,
        "usage": usage(answer.n_prompt, answer.n_completion, prompt_details(answer, chat=True)),
        "prompt_logprobs": None,
        "prompt_token_ids": prompt_ids if opts.return_token_ids else None,
        "prompt_text": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def _delta(token: Token, call_id: str, name: str) -> dict[str, Any]:
    if token.content:
        return {"content": token.content}
    if token.opens_tool_call:
        call = {"id": call_id, "type": "function", "index": 0, "function": {"name": name}}
        return {"content": None, "tool_calls": [call]}
    if token.arguments:
        return {"content": None, "tool_calls": [{"index": 0, "function": {"arguments": token.arguments}}]}
    return {}


def chat_stream_steps(answer: Answer[Options]) -> list[list[dict[str, Any]]]:
    """Chunks grouped by decode step: step 0 has each choice's role chunk and first token; step k token k."""
    choices, prompt_ids, opts = answer.choices, answer.prompt_ids, answer.opts
    head = answer.head("chat.completion.chunk")
    steps: list[list[dict[str, Any]]] = [[]]
    n_prompt = len(prompt_ids)
    for choice in choices:
        role = {"index": choice.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
        first: dict[str, Any] = {**head, "choices": [{**role, "finish_reason": None}]}
        if opts.continuous_usage:
            first["usage"] = running_usage(n_prompt, 0, chat=True)
        first["prompt_token_ids"] = prompt_ids if opts.return_token_ids else None
        first["prompt_text"] = None
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
            delta = _delta(token, call.id if call else "", call.name if call else "")
            if not last and not delta and not (opts.logprobs or opts.return_token_ids):
                continue  # nothing to say and nothing asked for that the chunk would carry: no chunk
            entry: dict[str, Any] = {
                "index": choice.index,
                "delta": delta,
                "logprobs": {"content": [chat_logprob(choice, position, opts.top_logprobs)]} if opts.logprobs else None,
                "finish_reason": finish_reason(choice, opts) if last else None,
            }
            if last:
                entry["stop_reason"] = None
            entry["token_ids"] = [token.id] if opts.return_token_ids else None
            chunk: dict[str, Any] = {**head, "choices": [entry]}
            if opts.continuous_usage:
                chunk["usage"] = running_usage(n_prompt, position + 1, chat=True)
            if last and not opts.include_usage:
                chunk["system_fingerprint"] = opts.fingerprint
            steps[position].append(chunk)
    if opts.include_usage:
        details = prompt_details(answer, chat=True)
        chunk = {**head, "choices": [], "usage": final_usage(n_prompt, answer.n_completion, details)}
        chunk["system_fingerprint"] = opts.fingerprint
        steps[-1].append(chunk)
    return steps
