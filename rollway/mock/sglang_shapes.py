"""What SGLang 0.5.23's OpenAI-compatible answers share: what a request asked for (``Ask``), usage, logprob entries,
``metadata``, how a choice ended, and the error envelope.

SGLang serialises with pydantic models whose serializers leave some unset fields out (token ids, ``hidden_states``,
``meta_info``, ``sglext``) and keep others as ``null`` (``matched_stop``, ``reasoning_content``, a usage's
``prompt_tokens_details``), so the renderers here write each key the way its model does. Its errors are
``{"object": "error", "message", "type", "param", "code"}``, not OpenAI's envelope.

The fake model's tokens as SGLang's detokenizer shows them: the end-of-sequence token is special and adds no text
(SGLang decodes with ``skip_special_tokens``), while the tool-call markup stays in the text, as Qwen's
``<tool_call>`` (an added token that is not special) does for the tool-call parser to read. A logprob entry shows
every token, the end-of-sequence one as ``<|end|>``, as SGLang's ``batch_decode`` of one id does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollway.mock import tokenizer as tok
from rollway.mock.answer import OPENAI_KEYS, Answer, Asked, logprob_entry, token_counts
from rollway.mock.model import Choice, Token


@dataclass(frozen=True, slots=True)
class Ask(Asked):
    """What the request asked to see, and how the mock's SGLang server is set up. ``return_token_ids`` gives chat's
    choices ``prompt_token_ids`` and ``response_token_ids``, completions' ``prompt_token_ids`` and ``token_ids``."""

    #: Chat: ``prompt_token_ids`` only.
    return_prompt_token_ids: bool = False
    return_meta_info: bool = False
    #: ``sglext.input_ids`` / ``sglext.output_ids`` (chat), asked in the body or by ``x-sglext-return-*`` headers.
    input_ids: bool = False
    output_ids: bool = False
    #: ``x-sglext-ids-framed: 1``: a stream's ids chunk is an ``event: sglext_ids``.
    framed: bool = False
    #: The server runs a tool-call parser (``--tool-call-parser``), and whether this request's output goes
    #: through it (it declares tools and does not say ``tool_choice: none``).
    parser: bool = False
    parse_tools: bool = False
    #: ``--enable-cache-report``: usage carries ``prompt_tokens_details.cached_tokens``.
    cache_report: bool = False


def visible(token: Token) -> str:
    """The text a token adds to the output: none for the end-of-sequence token."""
    return "" if token.id == tok.EOS_ID else token.text


def ended(choice: Choice) -> tuple[str, int | None]:
    """``(finish_reason, matched_stop)``: ``stop`` on the end-of-sequence token (matched, by id), else ``length``."""
    if choice.tokens and choice.tokens[-1].id == tok.EOS_ID:
        return "stop", tok.EOS_ID
    return "length", None


def metadata(completion_tokens: int) -> dict[str, Any]:
    """The answer's ``metadata``: the weight version that generated it (of the first choice's tokens)."""
    versions = [{"version": "default", "start": 0, "end": completion_tokens}]
    return {"weight_version": "default", "weight_versions": versions}


# ---------------------------------------------------------------------------------------------------- usage


def usage(prompt_tokens: int, completion_tokens: int, cached: int | None = None) -> dict[str, Any]:
    """``UsageInfo`` as pydantic dumps it (``cached``: the cache report's ``prompt_tokens_details``)."""
    return {
        **token_counts(prompt_tokens, completion_tokens),
        "prompt_tokens_details": None if cached is None else {"cached_tokens": cached},
        "reasoning_tokens": 0,
        "completion_tokens_details": None,
    }


def answer_usage(gen: Answer[Ask]) -> dict[str, Any]:
    return usage(gen.n_prompt, gen.n_completion, gen.cached if gen.opts.cache_report else None)


def without_nulls(data: dict[str, Any]) -> dict[str, Any]:
    """A usage dumped with ``exclude_none`` (text completions' usage chunk)."""
    return {k: v for k, v in data.items() if v is not None}


# ------------------------------------------------------------------------------------------------- logprobs


def chat_logprobs(choice: Choice, positions: range, top: int) -> dict[str, Any]:
    """Chat logprobs of the tokens at ``positions`` (``bytes`` are each token's; no token id)."""
    return {"content": [logprob_entry(choice, p, top, OPENAI_KEYS) for p in positions]}


def completion_logprobs(choice: Choice, positions: range, top: int, prompt: Choice | None = None) -> dict[str, Any]:
    """Completions' legacy logprobs: ``text_offset`` always -1 (SGLang does not compute it), ``top_logprobs``
    ``[]`` when no alternatives were asked, else one dict per token. ``prompt`` (an echo with logprobs): its
    tokens come first, the first one without a logprob."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    if prompt is not None:
        for position in range(len(prompt.tokens)):
            value, alternatives = prompt.logprob(position, top)
            tokens.append(prompt.tokens[position].text)
            values.append(None if position == 0 else value)
            tops.append(None if position == 0 else dict(alternatives))
    for position in positions:
        value, alternatives = choice.logprob(position, top)
        tokens.append(choice.tokens[position].text)
        values.append(value)
        tops.append(dict(alternatives))
    return {
        "text_offset": [-1] * len(tokens),
        "token_logprobs": values,
        "tokens": tokens,
        "top_logprobs": tops if top > 0 else [],
    }


# ---------------------------------------------------------------------------------------------------- errors


def error_body(message: str, type_: str = "BadRequest", code: int = 400) -> dict[str, Any]:
    """SGLang's ``ErrorResponse``: a ``ValueError`` of the request is ``BadRequest``, a check of its
    ``_validate_request`` ``BadRequestError``, a body pydantic cannot parse ``Bad Request``."""
    return {"object": "error", "message": message, "type": type_, "param": None, "code": code}
