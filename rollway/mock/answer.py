"""What both flavours' renderers share: what a chat or completion request asked to see (``Asked``), the generated
``Answer`` to it, a usage's token counts and the logprob entry of a token.

The engines write a logprob entry's fields in different orders: vLLM's chat ``token, logprob, bytes``; OpenAI's
models ``token, bytes, logprob`` (SGLang's chat, both engines' Responses API); vLLM's streamed Responses API deltas
``token, logprob`` (no bytes). The renderers pass the order they need.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from rollway.mock.model import Choice

#: A logprob entry's keys as vLLM's chat writes them.
VLLM_CHAT_KEYS = ("token", "logprob", "bytes")
#: As OpenAI's models write them (SGLang's chat, the Responses API's output text).
OPENAI_KEYS = ("token", "bytes", "logprob")
#: As vLLM's streamed Responses API deltas write them.
NO_BYTES_KEYS = ("token", "logprob")


@dataclass(frozen=True, slots=True)
class Asked:
    """What a chat or completion request asked to see, as both flavours read it; each flavour's subclass
    (``shapes.Options``, ``sglang_shapes.Ask``) adds its own fields and how its server is set up."""

    #: The token ids, where the flavour's engine puts them.
    return_token_ids: bool = False
    #: Chat: ``logprobs: true``; completions: ``logprobs`` given (an integer, 0 included).
    logprobs: bool = False
    top_logprobs: int = 0
    #: ``stream_options``: a usage chunk at the end of a stream, and a running usage on its chunks.
    include_usage: bool = False
    continuous_usage: bool = False
    echo: bool = False


AskT = TypeVar("AskT", bound=Asked)


@dataclass(frozen=True, slots=True)
class Answer(Generic[AskT]):
    """A generated answer to render: per prompt, its token ids and choices (chat has exactly one prompt)."""

    id: str
    created: int
    model: str
    batches: list[tuple[list[int], list[Choice]]]
    #: Prompt tokens found in the prefix cache.
    cached: int
    opts: AskT
    #: Each prompt's text (completions), what ``echo`` repeats.
    prompt_texts: tuple[str, ...] = ()
    #: Prompt tokens this request wrote to the prefix cache (vLLM reports them).
    created_cache: int = 0

    @property
    def prompt_ids(self) -> list[int]:
        return self.batches[0][0]

    @property
    def choices(self) -> list[Choice]:
        return self.batches[0][1]

    @property
    def n_prompt(self) -> int:
        """Prompt tokens, each prompt counted once however many choices it has."""
        return sum(len(ids) for ids, _ in self.batches)

    @property
    def n_completion(self) -> int:
        return sum(len(c.tokens) for _, choices in self.batches for c in choices)

    def numbered(self) -> list[tuple[int, list[int], Choice]]:
        """Every choice with its prompt's number and token ids, in ``index`` order (choice ``i`` of prompt ``p`` is
        ``index = p * n + i``)."""
        return [(number, ids, choice) for number, (ids, choices) in enumerate(self.batches) for choice in choices]

    def head(self, object_: str) -> dict[str, Any]:
        """The fields a body or a stream chunk starts with."""
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model}


def token_counts(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """A usage's token counts, in the order both engines write them."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


def logprob_entry(choice: Choice, position: int, top: int, keys: tuple[str, ...]) -> dict[str, Any]:
    """The logprob entry of the choice's token at ``position``, its ``keys`` in that order, then ``top_logprobs``:
    the ``top`` likeliest tokens, each with the same keys."""
    value, alternatives = choice.logprob(position, top)
    entry = _entry(choice.tokens[position].text, value, keys)
    entry["top_logprobs"] = [_entry(text, logprob, keys) for text, logprob in alternatives]
    return entry


def _entry(token: str, logprob: float, keys: tuple[str, ...]) -> dict[str, Any]:
    fields = {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
    return {key: fields[key] for key in keys}
