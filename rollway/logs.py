"""Structured logs with a request id.

Every HTTP request gets an id: the caller's ``X-Request-Id`` when it is a sane token (≤128 characters of
``[A-Za-z0-9._:-]``), else a fresh random one. It is echoed in the response's ``X-Request-Id`` and carried in
a context variable, so every log line written while serving the request (the gateway's, the store's,
uvicorn's access line) names it. Access lines go to stdout, the rest to stderr, as with uvicorn's defaults.
Lines are JSON objects (``log_format: json``) or ``key=value`` text.
Nothing logged here includes headers or bodies: no token or API key reaches a log line through this module.
A secret a client put in a URL's query string (``?token=``, ``?api_key=``, ``?key=``, ...: ``SECRET_PARAMETER``)
is written ``redacted`` in every line, the access line's path included (``redact_query``); the server itself
reads no secret from a query string, but a client that wrongly sends one must not have it kept in the logs.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
from contextvars import ContextVar
from typing import Any
from urllib.parse import unquote_plus

REQUEST_ID: ContextVar[str | None] = ContextVar("rollway_request_id", default=None)
HEADER = b"x-request-id"
_SAFE = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
#: A query parameter whose value is a secret: its name holds one of these words, alone or between ``-``, ``_`` or
#: ``.`` (``token``, ``access_token``, ``api_key``, ``apiKey``, ``key``, ``X-Amz-Signature``; not ``keyword``).
SECRET_PARAMETER = re.compile(
    r"(?:^|[-_.])(?:token|key|apikey|secret|password|passwd|pwd|auth|authorization|sig|signature|credentials?"
    r"|session|jwt)(?:$|[-_.])",
    re.IGNORECASE,
)
#: One ``name=value`` of a query string, after its ``?`` or an ``&`` (or ``;``).
_QUERY_PAIR = re.compile(r"([?&;])([^=&;#\s\"'?]+)=([^&;#\s\"']*)")


def redact_query(text: str) -> str:
    """``text`` with the value of each secret query parameter (``SECRET_PARAMETER``) of each URL in it replaced by
    ``redacted``; the rest as it was."""
    if "=" not in text:
        return text

    def one(pair: re.Match[str]) -> str:
        if SECRET_PARAMETER.search(unquote_plus(pair[2])):
            return f"{pair[1]}{pair[2]}=redacted"
        return pair[0]

    return _QUERY_PAIR.sub(one, text)


def request_id(headers: list[tuple[bytes, bytes]]) -> str:
    """The request's id: the caller's ``X-Request-Id`` if it is a sane token, else a new one."""
    for name, value in headers:
        if name == HEADER:
            text = value.decode("latin-1")
            if _SAFE.fullmatch(text):
                return text
            break
    return secrets.token_hex(16)


class RequestIdFilter(logging.Filter):
    """Adds ``request_id`` (None outside a request) to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, request_id, and the exception when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": _timestamp(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": redact_query(record.getMessage()),
            "request_id": getattr(record, "request_id", None),
        }
        if record.name == "uvicorn.access" and isinstance(record.args, tuple) and len(record.args) == 5:
            _, entry["method"], path, _, entry["status"] = record.args
            entry["path"] = redact_query(str(path))
        if record.exc_info:
            entry["exc"] = redact_query(self.formatException(record.exc_info))
        return json.dumps(entry, default=str)


class KeyValueFormatter(logging.Formatter):
    """``ts=... level=... logger=... request_id=... msg="..."`` (values with spaces or quotes are quoted)."""

    def format(self, record: logging.LogRecord) -> str:
        pairs = [
            ("ts", _timestamp(record.created)),
            ("level", record.levelname.lower()),
            ("logger", record.name),
            ("request_id", getattr(record, "request_id", None) or "-"),
            ("msg", redact_query(record.getMessage())),
        ]
        line = " ".join(f"{key}={_quote(str(value))}" for key, value in pairs)
        if record.exc_info:
            line += " exc=" + _quote(redact_query(self.formatException(record.exc_info)))
        return line


def log_config(log_format: str, level: str) -> dict[str, Any]:
    """A ``logging.config.dictConfig`` for uvicorn and Rollway's own loggers."""
    formatter = JsonFormatter if log_format == "json" else KeyValueFormatter

    def handler(stream: str) -> dict[str, Any]:
        return {
            "class": "logging.StreamHandler",
            "formatter": "structured",
            "filters": ["request_id"],
            "stream": f"ext://sys.{stream}",
        }

    upper = level.upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"request_id": {"()": RequestIdFilter}},
        "formatters": {"structured": {"()": formatter}},
        "handlers": {"default": handler("stderr"), "access": handler("stdout")},  # where uvicorn puts them
        "loggers": {
            "uvicorn": {"handlers": ["default"], "level": upper, "propagate": False},
            "uvicorn.error": {"level": upper},
            "uvicorn.access": {"handlers": ["access"], "level": upper, "propagate": False},
            "rollway": {"handlers": ["default"], "level": upper, "propagate": False},
        },
    }


def _timestamp(created: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(created % 1 * 1000):03d}Z"


def _quote(text: str) -> str:
    if text and not any(c in text for c in ' "=\n\t'):
        return text
    return json.dumps(text)
