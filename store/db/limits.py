"""How long a text column is and how large an integer column, where the store takes the value from a client.

PostgreSQL refuses a value its column cannot hold (``varchar(n)``, 32-bit integers) and SQLite stores it, so
without these checks one request was stored on one engine and failed as a database error (a 500) on the
other. The store refuses such text on both as a ``StoreValidationError`` before it writes anything (a span's
name is cut instead); the token
counts a span's attributes carry are only summaries of them (``stats``), kept when they fit and left out
(``None``) when they do not, the attributes themselves stored as sent.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Final

from rollway.store.errors import StoreValidationError

#: ``spans.trace_id``, ``span_id`` and ``parent_id``.
SPAN_ID_CHARS: Final = 64
#: ``spans.name``.
SPAN_NAME_CHARS: Final = 512
#: ``attempts.worker_id``, ``workers.worker_id``.
WORKER_ID_CHARS: Final = 128
#: The range of the 32-bit integer columns (token counts).
INT32_MIN: Final = -(2**31)
INT32_MAX: Final = 2**31 - 1


def check_text(value: str | None, limit: int, what: str) -> None:
    """Refuse ``value`` when it is longer than ``limit`` characters."""
    if value is not None and len(value) > limit:
        raise StoreValidationError(f"{what} is too long: at most {limit} characters, got {len(value)}")


def check_worker_id(worker_id: Any) -> None:
    if isinstance(worker_id, str):
        check_text(worker_id, WORKER_ID_CHARS, "worker_id")


def check_spans(spans: Iterable[Any]) -> None:
    """Refuse a batch with a span whose ids are longer than their columns (OpenTelemetry's are 32 and 16 hex
    digits: longer ones are not ids). A name longer than its column is cut to it: a tracer that names a span
    after its input (a prompt) must not lose its whole batch -- an agent's trajectory -- over it."""
    for span in spans:
        check_text(span.trace_id, SPAN_ID_CHARS, "trace_id")
        check_text(span.span_id, SPAN_ID_CHARS, "span_id")
        check_text(span.parent_id, SPAN_ID_CHARS, "parent_id")
        if span.name is not None and len(span.name) > SPAN_NAME_CHARS:
            span.name = span.name[:SPAN_NAME_CHARS]


def check_finite(value: Any, what: str) -> None:
    """Refuse a JSON value (a task's input or metadata, an attempt's metadata) that holds a number that is not
    finite. JSON has none, but Python's parser reads ``NaN`` and ``Infinity`` (and ``1e999`` as infinity), and the
    JSON columns' encoder writes them as ``null``: the value would be stored as something else than was sent,
    silently. Refused as rewards are."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                raise StoreValidationError(f"{what} holds {nonfinite_name(item)}: a JSON number must be finite")
        elif isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, list | tuple):
            pending.extend(item)


def nonfinite_name(number: float) -> str:
    """The name Python's json module writes a number that is not finite by: ``"NaN"``, ``"Infinity"`` or
    ``"-Infinity"``."""
    return "NaN" if math.isnan(number) else "Infinity" if number > 0 else "-Infinity"


def named_nonfinite(value: Any) -> Any:
    """``value`` (JSON) with each number that is not finite replaced by its name as a string (``"NaN"``,
    ``"Infinity"``, ``"-Infinity"``), for what the store keeps as it was reported rather than refuses (an agent
    server's completion metrics): the JSON columns' encoder would write such a number as ``null``, and a NaN loss
    would read back as no value at all."""
    if isinstance(value, float):
        return value if math.isfinite(value) else nonfinite_name(value)
    if isinstance(value, dict):
        return {key: named_nonfinite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [named_nonfinite(item) for item in value]
    return value


def check_task(spec: Any) -> None:
    """Refuse a task (``TaskSpec``, or what a controller creates) whose input or metadata ``check_finite`` refuses."""
    check_finite(spec.input, "input")
    check_finite(spec.metadata, "metadata")


def int32_or_none(value: Any) -> int | None:
    """``value`` as an integer for a 32-bit column (a count: an int, or a finite float, cut to an int), or None
    when it is not a number (a bool is not a count) or does not fit."""
    kind = type(value)
    if kind is float:
        if not math.isfinite(value):
            return None
        value = int(value)
    elif kind is not int:
        return None
    return int(value) if INT32_MIN <= value <= INT32_MAX else None
