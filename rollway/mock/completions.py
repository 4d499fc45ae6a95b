"""Text completions' bodies and stream chunks as vLLM 0.32 serialises them.

With ``return_token_ids: true``, non-streamed choices carry ``prompt_token_ids`` and ``token_ids``; streamed, each
choice's first chunk carries ``prompt_token_ids`` and every chunk ``token_ids``. Choice ``i`` of prompt ``p`` is
``index = p * n + i``. Chunks leave ``usage`` out unless ``continuous_usage_stats`` asks for it.

``echo`` starts the text with the prompt's (each choice's first chunk, streamed, which then also carries the
prompt's token ids) -- but not with ``return_token_ids``, which leaves the prompt's text out. With ``logprobs``, the
logprobs cover the prompt (the first token's null) and then the generated tokens, while ``token_ids`` holds the
generated ones only, and the choice's ``prompt_logprobs`` are set (vLLM computes the prompt's logprobs for an echo
with logprobs): per position, the prompt token and the likeliest others, by token id.
"""

from __future__ import annotations

from typing import Any

from rollway.mock import tokenizer as tok
from rollway.mock.answer import Answer
from rollway.mock.model import Choice, prompt_choice
from rollway.mock.shapes import Options, completion_logprobs, final_usage, prompt_details, running_usage, usage
from rollway.mock.tokenizer import SPECIAL_BY_ID


def completion_response(answer: Answer[Options]) -> dict[str, Any]:
    batches, opts = answer.batches, answer.opts
    out: list[dict[str, Any]] = []
    for number, (prompt_ids, choices) in enumerate(batches):
        echoed, prompt_logprobs = _echo(answer, number)
        for choice in choices:
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
                    "token_ids": choice.token_ids if opts.return_token_ids else None,
                    "prompt_logprobs": prompt_logprobs,
                    "prompt_token_ids": prompt_ids if opts.return_token_ids else None,
                    "routed_experts": None,
                }
            )
    return {
        **answer.head("text_completion"),
        "choices": out,
        "service_tier": None,
        "system_fingerprint": opts.fingerprint,
        "usage": usage(answer.n_prompt, answer.n_completion, prompt_details(answer, chat=False)),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def completion_stream_steps(answer: Answer[Options]) -> list[list[dict[str, Any]]]:
    opts = answer.opts
    head = answer.head("text_completion")
    flat = answer.numbered()
    steps: list[list[dict[str, Any]]] = [[]]
    offsets = [0] * len(flat)
    longest = max((len(c.tokens) for _, _, c in flat), default=0)
    for position in range(longest):
        if position >= len(steps):
            steps.append([])
        for index, (number, prompt_ids, choice) in enumerate(flat):
            if position >= len(choice.tokens):
                continue
            token = choice.tokens[position]
            last = position == len(choice.tokens) - 1
            first = position == 0
            echoed = _echo(answer, number)[0] if first else ""
            logprobs = None
            if opts.logprobs and first:
                logprobs = _echoed_logprobs(answer, number, choice, 1)
            elif opts.logprobs:
                logprobs = completion_logprobs(choice, position, position + 1, opts.top_logprobs, offsets[index])
            text = echoed + ("" if token.id in SPECIAL_BY_ID else token.text)
            offsets[index] += len(echoed) + len(token.text)
            # the prompt's ids come with the first chunk of an echo, or of any choice with return_token_ids
            show_prompt = first and (opts.echo or opts.return_token_ids)
            chunk: dict[str, Any] = {
                **head,
                "choices": [
                    {
                        "index": index,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": choice.finish_reason if last else None,
                        "stop_reason": None,
                        "prompt_token_ids": prompt_ids if show_prompt else None,
                        "token_ids": [token.id] if opts.return_token_ids else None,
                    }
                ],
            }
            if last and not opts.include_usage:
                chunk["system_fingerprint"] = opts.fingerprint
            if opts.continuous_usage:
                chunk["usage"] = running_usage(len(prompt_ids), position + 1, chat=False)
            steps[position].append(chunk)
    if opts.include_usage:
        details = prompt_details(answer, chat=False)
        chunk = {**head, "choices": [], "usage": final_usage(answer.n_prompt, answer.n_completion, details)}
        chunk["system_fingerprint"] = opts.fingerprint
        steps[-1].append(chunk)
    return steps


def _echo(answer: Answer[Options], number: int) -> tuple[str, list[dict[str, Any] | None] | None]:
    """What an ``echo`` puts before prompt ``number``'s completions (nothing with ``return_token_ids``), and the
    choices' ``prompt_logprobs``: set when asked for (``prompt_logprobs: k``, the prompt token and the ``k``
    likeliest others), or by an echo with logprobs (with the ``logprobs`` count)."""
    opts = answer.opts
    text = "" if not opts.echo or opts.return_token_ids else answer.prompt_texts[number]
    if opts.prompt_logprobs is not None:
        return text, _scored_prompt(answer, number, opts.prompt_logprobs)
    if not opts.echo or not opts.logprobs:
        return text, None
    return text, _scored_prompt(answer, number, opts.top_logprobs)


def _scored_prompt(answer: Answer[Options], number: int, top: int) -> list[dict[str, Any] | None]:
    """Per prompt position, the prompt token's logprob and the likeliest others' (``top`` entries in all, at least
    one; the first position: null)."""
    prompt_ids = answer.batches[number][0]
    choice = prompt_choice(prompt_ids, answer.opts.weights)
    scored: list[dict[str, Any] | None] = [None]
    for position in range(1, len(prompt_ids)):
        _, alternatives = choice.logprob(position, max(top, 1))
        ids = [prompt_ids[position], *(tok.piece_id(t) for t, _ in alternatives[1:])]
        scored.append(
            {
                str(i): {"logprob": lp, "rank": rank, "decoded_token": t}
                for rank, (i, (t, lp)) in enumerate(zip(ids, alternatives, strict=True), start=1)
            }
        )
    return scored


def _prompt_logprobs(prompt_ids: list[int], top: int, weights: str) -> dict[str, Any]:
    """The prompt's tokens as completion logprobs (the first token has no logprob: nothing came before it)."""
    out = completion_logprobs(prompt_choice(prompt_ids, weights), 0, len(prompt_ids), top, 0)
    out["token_logprobs"][0] = out["top_logprobs"][0] = None
    return out


def _echoed_logprobs(answer: Answer[Options], number: int, choice: Choice, stop: int) -> dict[str, Any]:
    """The logprobs of ``choice``'s first ``stop`` tokens, after the prompt's when the request has ``echo``."""
    top = answer.opts.top_logprobs
    if not answer.opts.echo:
        return completion_logprobs(choice, 0, stop, top, 0)
    prompt = _prompt_logprobs(answer.batches[number][0], top, answer.opts.weights)
    generated = completion_logprobs(choice, 0, stop, top, sum(len(t) for t in prompt["tokens"]))
    return {key: prompt[key] + generated[key] for key in prompt}
