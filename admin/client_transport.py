"""The admin client's HTTP layer: one ``httpx.AsyncClient`` with the admin token, retries with backoff and
jitter on connection errors and 5xx (never on 4xx), errors raised as ``RollwayAPIError`` /
``RollwayConnectionError``, JSON Lines streaming, and how arguments become paths, queries and bodies."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel

from rollway.admin.client_types import RetryPolicy, RollwayAPIError, RollwayConnectionError
from rollway.store import Backend

#: Methods whose request may be sent again after it may have reached the server (the server may already
#: have acted on any other): reads, and writes that set a state rather than add to it.
IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE"})
#: Errors that mean the request never reached the server: always safe to send again.
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
#: Request extension marking a write that is harmless twice (a heartbeat, a cancel, pausing an alias).
REPEATABLE = "rollway.repeatable"

M = TypeVar("M", bound=BaseModel)


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after", "").strip()
    try:
        return float(value) if value else None
    except ValueError:
        return None  # an HTTP date: use our own backoff


def dump_body(item: BaseModel | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(item, BaseModel):
        data: dict[str, Any] = item.model_dump(mode="json", exclude_unset=True)
        return data
    return dict(item)


def dump_backend(item: Backend | Mapping[str, Any]) -> dict[str, Any]:
    data = dump_body(item)
    if isinstance(item, Backend) and item.api_key is not None:  # a SecretStr dumps masked
        data["api_key"] = item.api_key.get_secret_value()
    return data


def path_segment(value: str) -> str:
    """A path segment, percent-encoded (ids and aliases are the caller's strings)."""
    return quote(value, safe="")


def query(**params: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in params.items():
        if value is None:
            continue
        out[key] = ("true" if value else "false") if isinstance(value, bool) else value
    return out


class Transport:
    """Calls to ``{root}/admin/v1``; ``timeout`` bounds each call (plus whatever the server may hold it)."""

    def __init__(
        self,
        root: str,
        token: str | None,
        *,
        timeout: float,
        retry: RetryPolicy,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.timeout = timeout
        self.retry = retry
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        base_url = f"{root}/admin/v1"
        self.http = httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout, transport=transport)

    async def aclose(self) -> None:
        await self.http.aclose()

    @staticmethod
    def _harmless_twice(request: httpx.Request) -> bool:
        """A read, a write with an Idempotency-Key, or a write that sets a state."""
        harmless = request.method in IDEMPOTENT or request.extensions.get(REPEATABLE, False)
        return bool(harmless) or "idempotency-key" in request.headers

    def _retryable(self, exc: httpx.TransportError, request: httpx.Request) -> bool:
        if isinstance(exc, NOT_SENT):
            return True
        if not isinstance(exc, httpx.NetworkError | httpx.TimeoutException | httpx.RemoteProtocolError):
            return False
        # The request may have reached the server and been done there, its answer lost.
        return self._harmless_twice(request)

    def _retryable_status(self, status: int, request: httpx.Request) -> bool:
        """Rollway's 503 means nothing was written; any other 5xx (a proxy's 502/504 in front of it, an
        internal error after part of a swap) may come after the server acted."""
        return status == 503 or (status >= 500 and self._harmless_twice(request))

    async def send(self, request: httpx.Request, *, stream: bool = False) -> httpx.Response:
        """Send with retries. An answer below 400 is returned (its body unread when ``stream``); a 4xx is raised
        at once; a 5xx or a connection error is retried, then raised."""
        attempt = 0
        while True:
            retry_after: float | None = None
            try:
                response = await self.http.send(request, stream=stream)
            except httpx.TransportError as exc:
                if attempt >= self.retry.retries or not self._retryable(exc, request):
                    reason = f"{type(exc).__name__}: {exc}".rstrip(": ")
                    raise RollwayConnectionError(f"{request.method} {request.url}: {reason}") from exc
            else:
                if response.status_code < 400:
                    return response
                if response.status_code == 404 and attempt > 0 and request.method == "DELETE":
                    return response  # a retry finds it gone: the try whose answer was lost deleted it
                await response.aread()
                await response.aclose()
                if attempt >= self.retry.retries or not self._retryable_status(response.status_code, request):
                    raise RollwayAPIError.of(response)
                retry_after = _retry_after(response)
            await asyncio.sleep(self.retry.delay(attempt, retry_after))  # backoff, not synchronisation
            attempt += 1

    def build(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, Any] | None = None,
        wait: float = 0,
        headers: Mapping[str, str] | None = None,
        repeatable: bool = False,
    ) -> httpx.Request:
        """``repeatable``: the write is harmless twice, so it is sent again after an answer was lost."""
        timeout = httpx.Timeout(self.timeout + wait) if wait else httpx.USE_CLIENT_DEFAULT
        request = self.http.build_request(method, path, json=json, params=params, timeout=timeout, headers=headers)
        if repeatable:
            request.extensions[REPEATABLE] = True
        return request

    async def request(self, method: str, path: str, **options: Any) -> httpx.Response:
        """One call (``options`` as for ``build``; ``wait``: seconds the server may hold it, added to the
        timeout). Its retries resend the same request, headers included (an ``Idempotency-Key`` stays)."""
        return await self.send(self.build(method, path, **options))

    async def model(self, model: type[M], method: str, path: str, **kwargs: Any) -> M:
        """One call whose answer is ``model``."""
        response = await self.request(method, path, **kwargs)
        return model.model_validate_json(response.content)

    async def json_lines(
        self, request: httpx.Request, on_response: Callable[[httpx.Response], None] | None = None
    ) -> AsyncIterator[Any]:
        """Stream a JSON Lines answer: a record per non-empty line (``on_response`` is given the response as soon
        as its headers arrive, also when no line follows). Retries happen only before the first byte; a stream
        that breaks later raises ``RollwayConnectionError``."""
        response = await self.send(request, stream=True)
        if on_response is not None:
            on_response(response)
        try:
            async for line in response.aiter_lines():
                if line.strip():
                    yield json.loads(line)
        except httpx.TransportError as exc:
            raise RollwayConnectionError(f"{request.method} {request.url}: stream broken: {exc!r}") from exc
        finally:
            await response.aclose()
