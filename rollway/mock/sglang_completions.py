"""Text completions' bodies and stream chunks as SGLang 0.5.23 serialises them (``serving_completions.py``).

With ``return_token_ids: true`` each choice carries ``token_ids`` and ``prompt_token_ids``, streamed or not: a
stream's chunks each carry their own token's id, and each choice's first chunk the prompt's. Not asked, the keys
are absent. Every decode step sends a chunk, its text ``""`` when the token adds none, so a stream's token ids and
logprobs are complete. Chunks carry ``"usage": null`` (or the running usage with ``continuous_usage_stats``); the
usage chunk leaves its nulls out. Choice ``i`` of prompt ``p`` is ``index = p * n + i``.

``echo`` puts the prompt's text first (token ids or not); with ``logprobs`` above 0 the prompt's tokens lead the
logprobs, the first one null.
"""

from __future__ import annotations

from typing import Any

from rollway.mock.answer import Answer
from rollway.mock.model import Choice, prompt_choice
from rollway.mock.sglang_shapes import (
    Ask,
    answer_usage,
    completion_logprobs,
    ended,
    metadata,
    usage,
    visible,
    without_nulls,
)


def _echo(gen: Answer[Ask], number: int) -> tuple[str, Choice | None]:
    """What an ``echo`` puts before prompt ``number``'s text, and the prompt to score when logprobs are asked."""
    ask = gen.opts
    if not ask.echo:
        return "", None
    scored = prompt_choice(gen.batches[number][0]) if ask.logprobs and ask.top_logprobs > 0 else None
    return gen.prompt_texts[number], scored


def completion_response(gen: Answer[Ask]) -> dict[str, Any]:
    ask, out = gen.opts, []
    for index, (number, prompt_ids, choice) in enumerate(gen.numbered()):
        echoed, prompt = _echo(gen, number)
        reason, matched = ended(choice)
        logprobs = None
        if ask.logprobs:
            logprobs = completion_logprobs(choice, range(len(choice.tokens)), ask.top_logprobs, prompt)
        entry: dict[str, Any] = {
            "index": index,
            "text": echoed + "".join(visible(t) for t in choice.tokens),
            "logprobs": logprobs,
            "finish_reason": reason,
            "matched_stop": matched,
        }
        if ask.return_token_ids:
            entry["token_ids"] = choice.token_ids
            entry["prompt_token_ids"] = prompt_ids
        out.append(entry)
    return {
        **gen.head("text_completion"),
        "choices": out,
        "usage": answer_usage(gen),
        "metadata": metadata(len(gen.choices[0].tokens)),
    }


def completion_stream_steps(gen: Answer[Ask]) -> list[list[dict[str, Any]]]:
    ask = gen.opts
    head = gen.head("text_completion")
    flat = gen.numbered()
    longest = max(len(c.tokens) for _, _, c in flat)
    steps: list[list[dict[str, Any]]] = [[] for _ in range(longest)]
    for position in range(longest):
        for index, (number, prompt_ids, choice) in enumerate(flat):
            if position >= len(choice.tokens):
                continue
            first, last = position == 0, position == len(choice.tokens) - 1
            echoed, prompt = _echo(gen, number) if first else ("", None)
            logprobs = None
            if ask.logprobs:
                logprobs = completion_logprobs(choice, range(position, position + 1), ask.top_logprobs, prompt)
            reason, matched = ended(choice) if last else (None, None)
            entry: dict[str, Any] = {
                "index": index,
                "text": echoed + visible(choice.tokens[position]),
                "logprobs": logprobs,
                "finish_reason": reason,
                "matched_stop": matched,
            }
            if ask.return_token_ids:
                entry["token_ids"] = [choice.tokens[position].id]
                if first:
                    entry["prompt_token_ids"] = prompt_ids
            running = usage(len(prompt_ids), position + 1) if ask.continuous_usage else None
            steps[position].append({**head, "choices": [entry], "usage": running})
    if ask.include_usage:
        steps[-1].append({**head, "choices": [], "usage": without_nulls(answer_usage(gen))})
    return steps
