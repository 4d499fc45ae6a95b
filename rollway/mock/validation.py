"""Request checks that answer as vLLM 0.32 does: ``{"error": {"message", "type", "param", "code"}}``.

vLLM answers two kinds of 400s. A body its request model cannot parse (malformed JSON, a missing field, a value
of the wrong type) is ``type: "Bad Request"`` with ``param`` the field's location (``body.messages``) and a
message listing pydantic's errors (``schema_error``). A value it parses but rejects (a range, a length, a
combination) is ``type: "BadRequestError"`` with ``param`` the field and a message ending in ``(parameter=...,
value=...)`` (``rejected``). An unknown model is a 404 ``NotFoundError``.
"""

from __future__ import annotations

from typing import Any

from rollway.envelope import envelope
from rollway.mock import tokenizer as tok


class BadRequest(Exception):
    """A request the mock refuses, with the envelope it answers."""

    def __init__(
        self, message: str, param: str | None = None, *, status: int = 400, type_: str = "BadRequestError"
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type = message, param, status, type_

    def body(self) -> dict[str, Any]:
        return envelope(self.message, self.type, param=self.param, code=self.status)


def _shown(value: Any) -> str:
    """A rejected input as pydantic's error lists it."""
    if isinstance(value, dict):
        return f"<dict of {len(value)} items>"
    if isinstance(value, list):
        return f"<list of {len(value)} items>"
    return str(value)


def schema_error(loc: str, kind: str, msg: str, value: Any, ctx: dict[str, Any] | None = None) -> BadRequest:
    """A body the request model cannot parse (``loc`` is ``body`` or ``body.<field>``)."""
    error: dict[str, Any] = {"type": kind, "loc": loc, "msg": msg, "input": _shown(value)}
    if ctx is not None:
        error["ctx"] = ctx
    return BadRequest(f"1 validation error:\n  {error}", loc, type_="Bad Request")


def missing(body: dict[str, Any], key: str) -> BadRequest:
    return schema_error(f"body.{key}", "missing", "Field required", body)


def rejected(message: str, param: str | None, value: Any = None) -> BadRequest:
    """A parsed value vLLM rejects; the message names the parameter (and the value) as vLLM's do."""
    extras = [f"parameter={param}"] if param is not None else []
    if value is not None:
        extras.append(f"value={value}")
    return BadRequest(f"{message} ({', '.join(extras)})" if extras else message, param)


def unknown_model(model: str, served: tuple[str, ...], *, aliases: bool = True) -> BadRequest:
    """vLLM's 404 for a model it does not serve (its embeddings route neither lists aliases nor names a param)."""
    if not aliases:
        return BadRequest(f"The model `{model}` does not exist.", None, status=404, type_="NotFoundError")
    message = f"The model `{model}` does not exist. Valid aliases: {', '.join(served)}."
    return BadRequest(message, "model", status=404, type_="NotFoundError")


# ---------------------------------------------------------------------------------------------- field types


def integer(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        msg = "Input should be a valid integer"
        raise schema_error(f"body.{key}", "int_parsing", f"{msg}, unable to parse string as an integer", value)
    return value


def number(body: dict[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        msg = "Input should be a valid number, unable to parse string as a number"
        raise schema_error(f"body.{key}", "float_parsing", msg, value)
    return float(value)


def boolean(body: dict[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        msg = "Input should be a valid boolean, unable to interpret input"
        raise schema_error(f"body.{key}", "bool_parsing", msg, value)
    return bool(value)


def mapping(body: dict[str, Any], key: str) -> dict[str, Any]:
    value = body.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise schema_error(f"body.{key}", "model_type", "Input should be a valid dictionary", value)
    return value


def sequence(body: dict[str, Any], key: str) -> list[Any] | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, list):
        raise schema_error(f"body.{key}", "list_type", "Input should be a valid list", value)
    return value


# ------------------------------------------------------------------------------------------ sampling limits

MAX_LOGPROBS = 20


def max_tokens(body: dict[str, Any], key: str, default: int, max_model_len: int) -> int:
    """``max_tokens`` (or its alias ``key``): at least 1, at most the context length."""
    value = integer(body, key)
    if value is None:
        return default
    if value < 1:
        raise rejected(f"{key} must be at least 1, got {value}.", key, value)
    if value > max_model_len:
        message = f"{key}={value} cannot be greater than max_model_len={max_model_len}."
        raise rejected(f"{message} Please request fewer output tokens.", key, value)
    return value


def logprobs_count(value: int) -> int:
    """How many alternatives per token (vLLM reads a negative count as the whole vocabulary)."""
    if not 0 <= value <= MAX_LOGPROBS:
        asked = value if value >= 0 else tok.ID_OFFSET + tok.VOCAB_SIZE
        message = f"Requested sample logprobs of {asked}, which is greater than max allowed: {MAX_LOGPROBS}"
        raise rejected(message, "logprobs", asked)
    return value


def prompt_length(n_prompt: int, max_model_len: int) -> None:
    if n_prompt > max_model_len:
        message = (
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
            f"{n_prompt} input tokens, which exceeds this limit even without any output tokens. Please reduce the "
            "length of the input prompt."
        )
        raise rejected(message, "input_tokens", n_prompt)


def sampling_ranges(body: dict[str, Any]) -> None:
    """vLLM's checks of ``n``, ``temperature`` and ``top_p``."""
    n = integer(body, "n")
    if n is not None and n < 1:
        raise rejected(f"n must be at least 1, got {n}.", None)
    temperature = number(body, "temperature")
    if temperature is not None and temperature < 0:
        raise rejected(f"temperature must be non-negative, got {temperature}.", "temperature", temperature)
    if temperature is not None and temperature > 2:
        raise rejected(f"temperature must be in [0, 2], got {temperature}.", "temperature", temperature)
    top_p = number(body, "top_p")
    if top_p is not None and not 0 < top_p <= 1:
        raise rejected(f"top_p must be in (0, 1], got {top_p}.", "top_p", top_p)
