"""The engines' own weight routes, as a weight update (``gateway.updates``) drives them.

- **vLLM** (started with ``VLLM_SERVER_DEV_MODE=1``, which adds its RL and dev routes): ``POST /pause?mode=wait``,
  ``POST /collective_rpc {"method": "reload_weights"}`` (from ``weights_path`` when given: the worker's
  ``reload_weights(weights_path=...)``, else from the model's own folder), ``POST /update_weight_version
  {"new_version": ...}``, ``POST /resume``; ``GET /weight_info`` reads the version back. Without dev mode those
  routes answer 404, and the update says to turn it on.
- **SGLang**: ``POST /update_weights_from_disk {"model_path": ..., "weight_version": ...}`` (it pauses and resumes
  itself), and ``GET /get_weight_version``.

Each call is an ``EngineStep`` of the update's record, with the engine's status and what it said.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from rollway.gateway.kinds import server_root
from rollway.gateway.masking import without_key
from rollway.store import Backend
from rollway.store.schemas import EngineStep

#: What each engine kind reloads with; the other kinds have no in-place reload Rollway knows.
RELOADABLE = ("vllm", "sglang")
#: How long one engine call may take, unless the update is given less.
STEP_TIMEOUT = 300.0
VERSION_TIMEOUT = 5.0
DETAIL_CHARS = 300


class EngineRefused(Exception):
    """An engine call failed: the update ends on the old version with this message."""


@dataclass
class Reload:
    """One backend's reload, as it went."""

    backend_id: str
    steps: list[EngineStep] = field(default_factory=list)
    version: str | None = None  # what the engine reports after the reload (None: it does not say)
    error: str | None = None


class EngineWeights:
    """Talks to the engines' weight routes over one aiohttp session (opened on first use, without keep-alive)."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def reload(
        self, backend: Backend, kind: str, to_version: str, weights_path: str | None, timeout: float
    ) -> Reload:
        """Reload ``backend``'s weights in place and give them ``to_version``; a failure is in ``error`` (after a
        best-effort resume, so a vLLM paused by this update does not stay paused)."""
        done = Reload(backend.backend_id)
        try:
            if kind == "vllm":
                await self._vllm(backend, done, to_version, weights_path, timeout)
            elif kind == "sglang":
                path = weights_path or backend.model
                body = {"model_path": path, "weight_version": to_version}
                answer = await self._call(backend, done, "update_weights_from_disk", "POST", body, timeout)
                if isinstance(answer, dict) and answer.get("success") is False:
                    raise EngineRefused(f"SGLang did not reload: {_detail(answer.get('message'))}")
            else:
                raise EngineRefused(f"a {kind} backend has no in-place reload Rollway can drive")
            done.version = await self.version(backend, kind, done)
        except EngineRefused as exc:
            done.error = f"backend '{backend.backend_id}': {exc}"
        return done

    async def _vllm(
        self, backend: Backend, done: Reload, to_version: str, weights_path: str | None, timeout: float
    ) -> None:
        await self._call(backend, done, "pause?mode=wait", "POST", None, timeout)
        try:
            rpc: dict[str, Any] = {"method": "reload_weights"}
            if weights_path is not None:
                rpc["kwargs"] = {"weights_path": weights_path}
            await self._call(backend, done, "collective_rpc", "POST", rpc, timeout)
            await self._call(backend, done, "update_weight_version", "POST", {"new_version": to_version}, timeout)
        finally:
            try:
                await self._call(backend, done, "resume", "POST", None, timeout)
            except EngineRefused:
                if done.error is None and all(step.ok for step in done.steps[:-1]):
                    raise

    async def version(self, backend: Backend, kind: str, done: Reload | None = None) -> str | None:
        """The weight version ``backend``'s engine reports (vLLM ``/weight_info``, SGLang ``/get_weight_version``);
        None when it does not say or cannot be asked."""
        route = {"vllm": "weight_info", "sglang": "get_weight_version"}.get(kind)
        if route is None:
            return None
        record = done if done is not None else Reload(backend.backend_id)
        try:
            answer = await self._call(backend, record, route, "GET", None, VERSION_TIMEOUT)
        except EngineRefused:
            return None
        value = answer.get("weight_version") if isinstance(answer, dict) else None
        return value if isinstance(value, str) else None

    async def _call(self, backend: Backend, done: Reload, route: str, method: str, body: Any, timeout: float) -> Any:
        """One engine call, noted as a step; an error status or no answer raises ``EngineRefused``."""
        url = f"{server_root(backend.base_url)}/{route}"
        action = route.split("?", 1)[0]
        headers = {"Content-Type": "application/json"}
        if backend.api_key is not None:
            headers["Authorization"] = f"Bearer {backend.api_key.get_secret_value()}"
        if self._session is None:
            # A new connection for every call: an update comes seconds or minutes after the last, and an engine
            # (uvicorn: after 5 s) closes an idle keep-alive connection on its own; reusing one just as it closes
            # fails the update with ServerDisconnectedError (seen in CI, between two training steps ~5 s apart).
            connector = aiohttp.TCPConnector(force_close=True)
            self._session = aiohttp.ClientSession(connector=connector, skip_auto_headers=("User-Agent",))
        began = time.monotonic()
        data = None if body is None else orjson.dumps(body)
        try:
            async with self._session.request(
                method,
                url,
                data=data,
                headers=headers,
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as response:
                raw = without_key(await response.read(), backend)  # an engine echoing the key
                status = response.status
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            reason = "timed out" if isinstance(exc, TimeoutError) else type(exc).__name__
            done.steps.append(
                EngineStep(
                    backend_id=backend.backend_id,
                    action=action,
                    ok=False,
                    detail=reason,
                    seconds=time.monotonic() - began,
                )
            )
            raise EngineRefused(f"{action}: no answer ({reason})") from None
        seconds = time.monotonic() - began
        try:
            answer = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            answer = raw.decode("utf-8", "replace")
        ok = status < 400
        detail = None if ok and action not in ("weight_info", "get_weight_version") else _detail(answer)
        done.steps.append(
            EngineStep(
                backend_id=backend.backend_id, action=action, ok=ok, status=status, seconds=seconds, detail=detail
            )
        )
        if status == 404 and action in ("pause", "collective_rpc", "update_weight_version", "weight_info"):
            raise EngineRefused(f"{action} answered 404: start vLLM with VLLM_SERVER_DEV_MODE=1 for its weight routes")
        if not ok:
            raise EngineRefused(f"{action} answered {status}: {detail}")
        return answer


def _detail(answer: Any) -> str:
    text = answer if isinstance(answer, str) else orjson.dumps(answer).decode()
    return text[:DETAIL_CHARS]
