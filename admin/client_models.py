"""The model-alias methods of ``AsyncRollwayClient`` (``/admin/v1/models``): list, show, put and delete an alias,
pause, resume and drain its calls, and swap its backends or version (weight updates are ``client_updates``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rollway.admin.client_transport import Transport, dump_backend, path_segment, query
from rollway.admin.model_schemas import ModelPage, ModelView
from rollway.store import Backend


class ModelsMixin:
    """Model aliases of ``AsyncRollwayClient`` (which provides the transport)."""

    _t: Transport

    async def list_models(self) -> list[ModelView]:
        return (await self._t.model(ModelPage, "GET", "/models")).items

    async def get_model(self, alias: str) -> ModelView:
        return await self._t.model(ModelView, "GET", f"/models/{path_segment(alias)}")

    async def put_model(
        self,
        alias: str,
        backends: Sequence[Backend | Mapping[str, Any]],
        *,
        version: str | None = None,
        sampling: Mapping[str, Any] | None = None,
    ) -> ModelView:
        """Create or replace an alias (version + 1 unless given). Backend API keys are sent, never shown."""
        body: dict[str, Any] = {"backends": [dump_backend(b) for b in backends]}
        body |= query(version=version, sampling=None if sampling is None else dict(sampling))
        return await self._t.model(ModelView, "PUT", f"/models/{path_segment(alias)}", json=body)

    async def delete_model(self, alias: str) -> None:
        await self._t.request("DELETE", f"/models/{path_segment(alias)}")

    async def pause_model(self, alias: str) -> ModelView:
        return await self._t.model(ModelView, "POST", f"/models/{path_segment(alias)}/pause", repeatable=True)

    async def resume_model(self, alias: str) -> ModelView:
        return await self._t.model(ModelView, "POST", f"/models/{path_segment(alias)}/resume", repeatable=True)

    async def drain_model(self, alias: str, timeout_seconds: float = 30.0) -> ModelView:
        """Wait until no call of ``alias`` is in flight in any gateway replica (``drained`` says whether that
        happened within ``timeout_seconds``). Pause the alias first, or new calls keep coming."""
        body = {"timeout_seconds": timeout_seconds}
        path = f"/models/{path_segment(alias)}/drain"
        return await self._t.model(ModelView, "POST", path, json=body, wait=timeout_seconds, repeatable=True)

    async def swap_model(
        self,
        alias: str,
        backends: Sequence[Backend | Mapping[str, Any]] | None = None,
        *,
        version: str | None = None,
        drain_timeout_seconds: float | None = None,
    ) -> ModelView:
        """New backends and/or version for new calls; with ``drain_timeout_seconds``, also wait for the old."""
        body = query(
            backends=None if backends is None else [dump_backend(b) for b in backends],
            version=version,
            drain_timeout_seconds=drain_timeout_seconds,
        )
        wait = drain_timeout_seconds or 0.0
        return await self._t.model(ModelView, "POST", f"/models/{path_segment(alias)}/swap", json=body, wait=wait)
