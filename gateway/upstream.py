"""Calls to backends: one pooled aiohttp session for the process, one function per try.

Retries and failover live in ``gateway.proxy`` and ``gateway.failover``; this module only knows how to send a
request, how a failure should be classified, and the backoff and ``Retry-After`` arithmetic.
"""

from __future__ import annotations

import asyncio
import email.utils
import functools
import os
import random
import re
import time
from typing import Any

import aiohttp

from rollway.gateway.errors import ResponseTooLarge, UpstreamFailure
from rollway.store import Backend


class Upstream:
    def __init__(self, *, connect_timeout: float, read_timeout: float) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=60)
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout, sock_read=self.read_timeout),
            skip_auto_headers=("User-Agent",),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def send(
        self,
        backend: Backend,
        path: str,
        payload: bytes,
        *,
        trace: tuple[str, str | None],
        deadline: float | None,
    ) -> aiohttp.ClientResponse:
        """POST ``payload`` to ``{backend.base_url}/{path}`` with ``trace`` (``traceparent``, ``tracestate``); the
        response is returned unread."""
        assert self._session is not None, "upstream session not started"
        headers = {"Content-Type": "application/json", "traceparent": trace[0]}
        if trace[1]:
            headers["tracestate"] = trace[1]
        if backend.api_key is not None:
            headers["Authorization"] = f"Bearer {backend.api_key.get_secret_value()}"
        # The session's timeouts unless the rollout's deadline is sooner. (Passing ``timeout=None`` to aiohttp
        # would mean "no timeout at all": no connect or read timeout, a hung backend held the call forever.)
        timeout = self._session.timeout
        if deadline is not None:
            remaining = deadline - time.time()
            if remaining <= 0:
                raise UpstreamFailure("deadline", "the rollout's deadline has passed")
            timeout = aiohttp.ClientTimeout(
                total=remaining, sock_connect=self.connect_timeout, sock_read=self.read_timeout
            )
        url = backend.base_url.rstrip("/") + "/" + path
        try:
            return await self._session.post(url, data=payload, headers=headers, timeout=timeout)
        except aiohttp.ConnectionTimeoutError as exc:  # no connection: safe to fail over, like a refused one
            raise UpstreamFailure("connect", f"cannot reach backend '{backend.backend_id}': connect timeout") from exc
        except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            raise UpstreamFailure("connect", f"cannot reach backend '{backend.backend_id}': {_why(exc)}") from exc
        except TimeoutError as exc:
            raise UpstreamFailure("timeout", f"backend '{backend.backend_id}' timed out") from exc


def _why(exc: BaseException) -> str:
    """Why a connection failed, in the OS's words ("Connection refused", "Name or service not known") — never the
    backend's address: agents read this message, and a backend's URL is the operator's business."""
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "the backend closed the connection"
    code, reason = getattr(exc, "errno", None), getattr(exc, "strerror", None)
    if isinstance(code, int) and code > 0:
        return f"{os.strerror(code)} ({type(exc).__name__})"
    if isinstance(code, int) and isinstance(reason, str):  # resolver errors (gaierror): negative codes
        return f"{reason} ({type(exc).__name__})"
    return type(exc).__name__


def retry_after(value: str | None, cap: float) -> float | None:
    """Seconds from a ``Retry-After`` header (delta seconds or an HTTP date), capped."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        parsed = email.utils.parsedate_to_datetime(value) if value else None
        if parsed is None:
            return None
        seconds = parsed.timestamp() - time.time()
    return max(0.0, min(seconds, cap))


def backoff(attempt: int, cap: float) -> float:
    """Exponential backoff with full jitter: 50 ms, 100 ms, 200 ms, ... (random in [0, that])."""
    return random.uniform(0, min(cap, 0.05 * 2**attempt))


async def wait(seconds: float) -> None:
    if seconds > 0:
        await asyncio.sleep(seconds)


#: Keys shorter than this are not looked for in error bodies: masking ``null`` would break the JSON around it.
MASKED_KEY_LENGTH = 8
#: What a backend's key is replaced with, wherever it is found.
MASK = "***"


def backend_key(backend: Backend | None) -> str:
    """The backend's API key, to look for in what the backend sends back; empty for no key or a placeholder for a
    keyless server ("x", "null"), which is not a secret to look for."""
    key = backend.api_key.get_secret_value() if backend is not None and backend.api_key is not None else ""
    return key if len(key) >= MASKED_KEY_LENGTH else ""


def key_bytes(backend: Backend | None) -> bytes:
    """``backend_key`` as UTF-8: how the key reads in a body that does not escape it."""
    return backend_key(backend).encode()


def without_key(raw: bytes, backend: Backend | None) -> bytes:
    """A backend's body (an error, or an answer quoting its request) with the backend's API key, should the
    backend echo it (``you sent Bearer sk-...``), masked: the body is passed to the client and recorded in the
    span, neither may hold the key. ``masked`` says in which forms."""
    return masked(raw, backend_key(backend))


def masked(raw: bytes, key: str) -> bytes:
    """``raw`` with every occurrence of ``key`` replaced by ``MASK``: as it is, and as a JSON text may write it,
    any of its characters escaped (``sk\\u002d...``, ``\\/`` for ``/``), which a client's JSON parser turns back
    into the key. Valid JSON stays valid: the mask replaces the key inside its string."""
    if not key:
        return raw
    plain = key.encode()
    if plain not in raw and b"\\" not in raw:  # (an escaped key has a backslash: most bodies are passed at once)
        return raw
    return _key_pattern(key).sub(_masking, raw)


def _masking(match: re.Match[bytes]) -> bytes:
    return (match.group(1) or b"") + MASK.encode()


@functools.lru_cache(maxsize=64)
def _key_pattern(key: str) -> re.Pattern[bytes]:
    """The key written with each character as itself or as a JSON escape. A match that begins with an escape
    begins where its backslash is not itself escaped: after an even number of backslashes (group 1, kept)."""
    escaped = b"(?<!\\\\)((?:\\\\\\\\)*)(?:" + b"|".join(_escapes(key[0])) + b")"
    first = b"(?:" + escaped + b"|" + re.escape(key[0].encode()) + b")"
    return re.compile(first + b"".join(b"(?:" + b"|".join(_forms(c)) + b")" for c in key[1:]))


def _forms(char: str) -> list[bytes]:
    return [re.escape(char.encode()), *_escapes(char)]


#: JSON's two-character escapes (RFC 8259, section 7), beside ``\\uXXXX`` which can write any character.
_SHORT_ESCAPES = {
    '"': b'\\"',
    "\\": b"\\\\",
    "/": b"\\/",
    "\b": b"\\b",
    "\f": b"\\f",
    "\n": b"\\n",
    "\r": b"\\r",
    "\t": b"\\t",
}


def _escapes(char: str) -> list[bytes]:
    """Patterns of the JSON escapes of ``char``: ``\\uXXXX`` with hex digits of either case (a character beyond
    the Basic Multilingual Plane: its UTF-16 surrogate pair), and its short escape if it has one."""
    units = char.encode("utf-16-be")
    hexes = (f"{int.from_bytes(units[i : i + 2]):04x}" for i in range(0, len(units), 2))
    unicode = b"".join(
        b"\\\\u" + b"".join(f"[{d}{d.upper()}]".encode() if d.isalpha() else d.encode() for d in digits)
        for digits in hexes
    )
    short = _SHORT_ESCAPES.get(char)
    return [unicode] if short is None else [unicode, re.escape(short)]


async def read_quietly(response: aiohttp.ClientResponse) -> bytes:
    """An error answer's body (empty when it broke off); the connection goes back to the pool."""
    try:
        return await response.read()
    except (aiohttp.ClientError, TimeoutError):
        return b""
    finally:
        response.release()


def passthrough_headers(response: aiohttp.ClientResponse) -> list[tuple[bytes, bytes]]:
    """The headers of a backend's error answer that the client gets with it."""
    out = [(b"content-type", response.headers.get("Content-Type", "application/json").encode())]
    if "Retry-After" in response.headers:
        out.append((b"retry-after", response.headers["Retry-After"].encode()))
    return out


async def read_whole(response: Any, limit: int) -> bytes:
    """A whole answer's body: a body that breaks off or stalls is an ``UpstreamFailure`` of its try, before any byte
    reached the client; so is one over ``limit`` bytes, left unread past it (a backend sending without end would
    have the process hold it all). A body of a declared length within the limit is read in one go, as is one
    already read (``capture.refused_stream_options`` reads a 400's: ``read`` gives it again)."""
    try:
        declared = getattr(response, "content_length", None)  # (a LiteLLM answer has its body already)
        if isinstance(response, aiohttp.ClientResponse) and declared is None and not response.content.at_eof():
            parts, size = [], 0
            async for part in response.content.iter_any():
                size += len(part)
                if size > limit:
                    raise ResponseTooLarge(limit)
                parts.append(part)
            return b"".join(parts)
        if (declared or 0) > limit:
            raise ResponseTooLarge(limit)
        body: bytes = await response.read()
        return body
    except ResponseTooLarge as exc:
        response.close()
        raise UpstreamFailure("response_too_large", str(exc)) from exc
    except TimeoutError as exc:  # headers came, the body stalled
        response.close()
        raise UpstreamFailure("read_timeout", "the backend timed out sending its answer") from exc
    except aiohttp.ClientError as exc:  # the body broke off (connection dropped)
        response.close()
        raise UpstreamFailure("broken", f"the backend answer broke: {type(exc).__name__}") from exc
