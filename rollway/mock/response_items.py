"""What both flavours' Responses API answers share (``POST /v1/responses``; both engines serialise with OpenAI's
models): the generated ``ResponseAnswer``, the output text part and message item, the logprobs of the output, and
a stream's numbered events about its one output item."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from rollway.mock.answer import OPENAI_KEYS, logprob_entry
from rollway.mock.model import Choice

LOGPROBS_INCLUDE = "message.output_text.logprobs"


@dataclass(frozen=True, slots=True)
class ResponseAnswer:
    """A generated answer to the Responses API, with what the request asked for."""

    id: str
    created: int
    model: str
    choice: Choice
    prompt_ids: list[int]
    #: Prompt tokens found in the prefix cache.
    cached: int
    request: dict[str, Any]
    #: The output item's id, after its prefix (``msg_`` or ``fc_``).
    item_key: str
    #: ``include: ["message.output_text.logprobs"]``, and how many alternatives per token.
    logprobs: bool
    top_logprobs: int
    #: What vLLM reports besides: the rendered prompt, the prompt tokens written to the cache, the output limit it
    #: applied, and ``enable_response_messages``.
    prompt_text: str = ""
    created_cache: int = 0
    max_output_tokens: int = 0
    messages: bool = False

    @property
    def message_id(self) -> str:
        return f"msg_{self.item_key}"

    @property
    def call_item_id(self) -> str:
        return f"fc_{self.item_key}"


def output_logprobs(answer: ResponseAnswer) -> list[dict[str, Any]] | None:
    """The logprobs of every output token (None: not asked for)."""
    if not answer.logprobs:
        return None
    choice = answer.choice
    return [logprob_entry(choice, p, answer.top_logprobs, OPENAI_KEYS) for p in range(len(choice.tokens))]


def output_text(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def message_item(item_id: str, content: list[dict[str, Any]], status: str, phase: str | None) -> dict[str, Any]:
    return {"id": item_id, "content": content, "role": "assistant", "status": status, "type": "message", "phase": phase}


def request_number(request: dict[str, Any], key: str, default: float | None) -> float | None:
    """A number of the request, echoed as a float (``default``: not given as a number)."""
    value = request.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else default


class EventStream:
    """The events of a Responses API stream, numbered from 0, about its one output item (``item_id``)."""

    def __init__(self, item_id: str) -> None:
        self.where = {"item_id": item_id, "output_index": 0}
        self._numbers = itertools.count()

    def number(self) -> int:
        return next(self._numbers)

    def event(self, type_: str, **fields: Any) -> dict[str, Any]:
        """An event, its fields in OpenAI's models' (alphabetical) order."""
        return dict(sorted({**fields, "sequence_number": self.number(), "type": type_}.items()))

    def message_added(self, message: dict[str, Any], part: dict[str, Any]) -> list[dict[str, Any]]:
        """The message item opened, then its text part."""
        return [
            self.event("response.output_item.added", item=message, output_index=0),
            self.event("response.content_part.added", content_index=0, part=part, **self.where),
        ]

    def text_delta(self, delta: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
        return self.event("response.output_text.delta", content_index=0, delta=delta, logprobs=logprobs, **self.where)

    def message_done(self, text: str, message: dict[str, Any]) -> list[dict[str, Any]]:
        """The text done, then its part and the message item closed (``message`` holds the finished part)."""
        return [
            self.event("response.output_text.done", content_index=0, logprobs=[], text=text, **self.where),
            self.event("response.content_part.done", content_index=0, part=message["content"][0], **self.where),
            self.event("response.output_item.done", item=message, output_index=0),
        ]
