"""What engine serves a backend, and whether its calls come back trainable.

A backend put without a kind is ``auto``: the gateway asks the server what it is, once, and serves its calls as
that kind (vLLM and SGLang get the token-id capture; anything else is OpenAI-compatible):

- SGLang answers ``GET /get_model_info`` (and ``/model_info`` in later releases) with its ``model_path``;
- vLLM answers ``GET /version`` with ``{"version": ...}``;
- anything else (OpenAI, a proxy, a server that answers neither) is ``openai``.

A backend that cannot be reached is not decided: its calls go as ``openai`` (they fail on the same connection
anyway) and the next call asks again. Nor is one whose routes answer an error that says nothing of what it is
(5xx, 429, 401/403: a server starting behind an ingress, say): its calls go as ``openai`` for ``RETRY_AFTER``
seconds, then it is asked again. A detection is forgotten after a try on the backend fails (refused connection,
5xx), so a server replaced by another engine at the same address is asked again. Only the kind is kept: the
backend's other fields (model, key, version) are always the alias's current ones.

``TrainableWatch`` counts, per alias, the completions whose span has no token ids (not trainable), logs the first
of each alias once, and keeps the counts for ``GET /admin/v1/models``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp
import orjson

from rollway.store import Backend

log = logging.getLogger("rollway.gateway")

#: The routes that tell SGLang (tried first: a server that answers them is not vLLM).
SGLANG_ROUTES = ("get_model_info", "model_info")
DETECT_TIMEOUT = 5.0
#: How long a backend whose routes answered an error that says nothing of its engine is served as ``openai``.
RETRY_AFTER = 30.0
#: How long a reachability probe (``BackendKinds.reachable``: a TCP connect) may take, and how long it is kept.
PROBE_TIMEOUT = 2.0
PROBE_KEPT = 5.0
#: Answers to a probe that tell nothing of the server (it is busy, starting, or wants other credentials).
UNDECIDED = frozenset({401, 403, 407, 408, 425, 429})


def server_root(base_url: str) -> str:
    """The server's root, where its own routes live: the base URL without a trailing ``/v1``."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


class BackendKinds:
    """The detected kind of each ``auto`` backend (by id and address), asked of the server once."""

    def __init__(self, timeout: float = DETECT_TIMEOUT) -> None:
        self.timeout = timeout
        self._known: dict[tuple[str, str], str] = {}  # (backend id, base URL) → its kind
        self._until: dict[tuple[str, str], float] = {}  # undecided ones: served as openai until then
        self._asking: dict[tuple[str, str], asyncio.Future[str | None]] = {}
        self._probed: dict[tuple[str, str], tuple[float, bool]] = {}  # (backend id, base URL) → (when, answered)
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def detected(self) -> Mapping[str, str]:
        """Backend id → the kind detected for it (``auto`` backends this process has asked)."""
        return {backend_id: kind for (backend_id, _), kind in self._known.items()}

    async def resolve(self, backend: Backend) -> Backend:
        """``backend`` as the kind it serves: itself unless it is ``auto``; then a copy with the detected kind
        (``openai`` while it cannot be asked)."""
        if backend.kind != "auto":
            return backend
        key = (backend.backend_id, backend.base_url)
        kind = self._known.get(key)
        if kind is None and time.monotonic() >= self._until.get(key, 0.0):
            kind = await self.detect(backend)
        return backend.model_copy(update={"kind": kind or "openai"})

    async def detect(self, backend: Backend) -> str | None:
        """Ask the server what it is: ``sglang``, ``vllm`` or ``openai``; None when it cannot be reached. One
        question at a time per backend: calls arriving meanwhile wait for its answer."""
        key = (backend.backend_id, backend.base_url)
        asking = self._asking.get(key)
        if asking is None:
            asking = self._asking[key] = asyncio.ensure_future(self._ask(backend))
            asking.add_done_callback(lambda done: self._decided(key, done))
        return await asyncio.shield(asking)

    def _decided(self, key: tuple[str, str], done: asyncio.Future[str | None]) -> None:
        """Keep what the question found, whether or not anyone still waits for it."""
        self._asking.pop(key, None)
        if done.cancelled() or done.exception() is not None:
            return
        kind = done.result()
        if kind is not None:
            self._known[key] = kind
            self._until.pop(key, None)

    def forget(self, backend: Backend) -> None:
        """A try on ``backend`` failed: its kind is asked again on its next call."""
        self._until.pop((backend.backend_id, backend.base_url), None)
        if self._known.pop((backend.backend_id, backend.base_url), None) is not None:
            log.info("backend '%s' failed: its kind will be detected again", backend.backend_id)

    async def _ask(self, backend: Backend) -> str | None:
        root = server_root(backend.base_url)
        headers = {}
        if backend.api_key is not None:
            headers["Authorization"] = f"Bearer {backend.api_key.get_secret_value()}"
        undecided: list[int] = []
        try:
            kind = None
            for route in SGLANG_ROUTES:
                status, body = await self._get(f"{root}/{route}", headers)
                if status == 200 and isinstance(body, dict) and "model_path" in body:
                    kind = "sglang"
                    break
                if status >= 500 or status in UNDECIDED:
                    undecided.append(status)
            if kind is None:
                status, body = await self._get(f"{root}/version", headers)
                if status == 200 and isinstance(body, dict) and isinstance(body.get("version"), str):
                    kind = "vllm"
                elif status >= 500 or status in UNDECIDED:
                    undecided.append(status)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            log.warning("backend '%s': cannot detect its kind (%s)", backend.backend_id, type(exc).__name__)
            return None
        if kind is None and undecided:  # e.g. a 503 while it starts: it may be vLLM all the same
            self._until[(backend.backend_id, backend.base_url)] = time.monotonic() + RETRY_AFTER
            log.warning(
                "backend '%s': its routes answered %s, which does not tell its engine; served as openai, asked "
                "again in %.0f s",
                backend.backend_id,
                sorted(set(undecided)),
                RETRY_AFTER,
            )
            return None
        kind = kind or "openai"
        log.info("backend '%s' at %s is %s", backend.backend_id, root, kind)
        return kind

    async def reachable(self, backend: Backend) -> bool:
        """Whether ``backend``'s server accepts a connection now (a TCP connect to its address, nothing sent, so
        the engine sees no request), asked at most once per ``PROBE_KEPT`` seconds: what the admin API shows for
        a backend that no call has tried yet."""
        key = (backend.backend_id, backend.base_url)
        now = time.monotonic()
        kept = self._probed.get(key)
        if kept is not None and now - kept[0] < PROBE_KEPT:
            return kept[1]
        parts = urlsplit(backend.base_url)
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
            async with asyncio.timeout(PROBE_TIMEOUT):
                _, writer = await asyncio.open_connection(parts.hostname, port)
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            answered = True
        except (TimeoutError, OSError, ValueError):
            answered = False
        self._probed[key] = (time.monotonic(), answered)
        return answered

    async def _get(self, url: str, headers: dict[str, str]) -> tuple[int, object]:
        """A GET's status and its JSON body (None when it is not JSON); a connection failure raises."""
        if self._session is None:
            timeout = aiohttp.ClientTimeout(total=self.timeout)
            self._session = aiohttp.ClientSession(timeout=timeout, skip_auto_headers=("User-Agent",))
        async with self._session.get(url, headers=headers, allow_redirects=False) as response:
            try:
                return response.status, orjson.loads(await response.read())
            except orjson.JSONDecodeError:
                return response.status, None


@dataclass
class Capture:
    """What one alias's completions in this process gave: how many, and how many had no token ids."""

    completions: int = 0
    untrainable: int = 0
    without_logprobs: int = 0  # trainable ones whose logprobs do not cover every output token


class TrainableWatch:
    """Counts completions without token ids per alias, and says so in the log once per alias."""

    def __init__(self) -> None:
        self.by_alias: dict[str, Capture] = {}

    def observe(self, alias: str, backend: Backend | None, trainable: bool, logprobs_complete: bool = True) -> None:
        capture = self.by_alias.get(alias)
        if capture is None:
            capture = self.by_alias[alias] = Capture()
        capture.completions += 1
        if trainable:
            capture.without_logprobs += not logprobs_complete
            return
        capture.untrainable += 1
        if capture.untrainable == 1:
            where = f"backend '{backend.backend_id}' (kind {backend.kind})" if backend is not None else "its backend"
            engine = backend is not None and backend.kind in ("vllm", "sglang")
            advice = (
                "the engine did not return them: check its version and flags"
                if engine
                else "put the model with --kind vllm or sglang if that engine serves it"
            )
            log.warning(
                "model '%s': completions from %s come back without token ids, so they are not trainable; %s "
                "(see docs/backends.md)",
                alias,
                where,
                advice,
            )

    def counts(self, alias: str) -> Capture:
        return self.by_alias.get(alias) or Capture()
