"""Calls to backends: one pooled aiohttp session for the process, one function per try, and the answer of a try
as the call sees it (``Answer``), whatever carried it.

``Answer`` is the seam between a call and its transport: aiohttp's answers (``AiohttpAnswer``) and LiteLLM's
(``gateway.litellm_backend``) both implement it, and each maps its transport's failures to ``UpstreamFailure`` in
one place, so nothing above this module sees aiohttp's (or httpx's) exception types. Retries and failover live in
``gateway.proxy`` and ``gateway.failover``; this module knows how to send a request, how a failure is classified,
and the backoff and ``Retry-After`` arithmetic.
"""

from __future__ import annotations

import asyncio
import email.utils
import os
import random
import time
from collections.abc import AsyncIterator, Mapping
from typing import Protocol
from urllib.parse import urlsplit

import aiohttp

from rollway.gateway.errors import ResponseTooLarge, UpstreamFailure
from rollway.store import Backend


class Answer(Protocol):
    """A backend's answer to one try, unread: its status and headers, then its body, read whole or as it comes.
    Every failure of the transport while reading is an ``UpstreamFailure`` (raised by ``read``, or named by
    ``failure`` for ``chunks``)."""

    status: int
    headers: Mapping[str, str]

    async def read(self, limit: int) -> bytes:
        """The whole body. One that breaks off or stalls is an ``UpstreamFailure`` of the try, before any byte
        reached the client; so is one over ``limit`` bytes, left unread past it (a backend sending without end
        would have the process hold it all). Read again, it is the same bytes."""
        ...

    async def read_error(self) -> bytes:
        """An error answer's body (empty when it broke off); the connection goes back to the pool."""
        ...

    def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, read straight from the transport (nothing between the relay and each read):
        a body that breaks off or stalls raises the transport's own error, which ``failure`` names."""
        ...

    def failure(self, exc: Exception) -> UpstreamFailure | None:
        """What ``exc``, raised while reading ``chunks``, is to the call: the body broken off or stalled (an
        ``UpstreamFailure``, kind ``broken``), or None when it is not the transport's."""
        ...

    def release(self) -> None:
        """The body is read: the connection goes back to the pool."""

    def close(self) -> None:
        """Drop the connection (the client left, or the call failed): the backend stops generating."""


#: What breaks an aiohttp body off: the connection dropped or reset, a chunked body cut short, the read timeout.
_BROKEN = (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, TimeoutError)


class AiohttpAnswer:
    """``Answer`` over aiohttp's response (an OpenAI-compatible backend: vLLM, SGLang, OpenAI, ...)."""

    __slots__ = ("_body", "_response", "headers", "status")

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status
        self.headers: Mapping[str, str] = response.headers
        self._body: bytes | None = None

    async def read(self, limit: int) -> bytes:
        if self._body is not None:
            return self._body
        response = self._response
        try:
            declared = response.content_length
            if declared is None and not response.content.at_eof():
                parts, size = [], 0
                async for part in response.content.iter_any():
                    size += len(part)
                    if size > limit:
                        raise ResponseTooLarge(limit)
                    parts.append(part)
                body = b"".join(parts)
            elif (declared or 0) > limit:
                raise ResponseTooLarge(limit)
            else:
                body = await response.read()
        except ResponseTooLarge as exc:
            response.close()
            raise UpstreamFailure("response_too_large", str(exc)) from exc
        except TimeoutError as exc:  # headers came, the body stalled
            response.close()
            raise UpstreamFailure("read_timeout", "the backend timed out sending its answer") from exc
        except aiohttp.ClientError as exc:  # the body broke off (connection dropped)
            response.close()
            raise UpstreamFailure("broken", f"the backend answer broke: {type(exc).__name__}") from exc
        self._body = body
        return body

    async def read_error(self) -> bytes:
        try:
            if self._body is None:
                self._body = await self._response.read()
            return self._body
        except (aiohttp.ClientError, TimeoutError):
            return b""
        finally:
            self._response.release()

    def chunks(self) -> AsyncIterator[bytes]:
        return self._response.content.iter_any()

    def failure(self, exc: Exception) -> UpstreamFailure | None:
        if isinstance(exc, _BROKEN):
            return UpstreamFailure("broken", f"the backend stream broke: {type(exc).__name__}")
        return None

    def release(self) -> None:
        self._response.release()

    def close(self) -> None:
        self._response.close()


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
    ) -> AiohttpAnswer:
        """POST ``payload`` to ``{backend.base_url}/{path}`` with ``trace`` (``traceparent``, ``tracestate``); the
        answer is returned unread."""
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
            # Redirects are not followed: following one re-posts the agent's body, with the backend's key, to
            # wherever the answer points (and a loop ends only in aiohttp's TooManyRedirects).
            response = await self._session.post(
                url, data=payload, headers=headers, timeout=timeout, allow_redirects=False
            )
        except aiohttp.ConnectionTimeoutError as exc:  # no connection: safe to fail over, like a refused one
            raise UpstreamFailure("connect", f"cannot reach backend '{backend.backend_id}': connect timeout") from exc
        except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            raise UpstreamFailure("connect", f"cannot reach backend '{backend.backend_id}': {_why(exc)}") from exc
        except TimeoutError as exc:
            raise UpstreamFailure("timeout", f"backend '{backend.backend_id}' timed out") from exc
        if 300 <= response.status < 400:
            response.close()
            raise UpstreamFailure("redirect", redirected(backend, response.status, response.headers.get("Location")))
        return AiohttpAnswer(response)


def redirected(backend: Backend, status: int, location: str | None) -> str:
    """What a backend's redirect is to the call: its status and the host it points to. Only the host: the
    location's path and query are the backend's to know (they may carry a signed URL's token)."""
    where = "no location"
    if location:
        try:
            host = urlsplit(location).hostname
        except ValueError:
            host = None
        where = f"a redirect to host '{host}'" if host else "a redirect to another path"
    return f"backend '{backend.backend_id}' answered {status} with {where}; the gateway does not follow redirects"


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


def passthrough_headers(answer: Answer) -> list[tuple[bytes, bytes]]:
    """The headers of a backend's error answer that the client gets with it."""
    out = [(b"content-type", answer.headers.get("Content-Type", "application/json").encode())]
    if "Retry-After" in answer.headers:
        out.append((b"retry-after", answer.headers["Retry-After"].encode()))
    return out
