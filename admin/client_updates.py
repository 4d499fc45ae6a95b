"""The weight-update methods of ``AsyncRollwayClient`` (``POST /admin/v1/models/{alias}/updates`` and
``/admin/v1/updates``): the reload form whole, the trainer form's begin, commit and abort, and the records."""

from __future__ import annotations

from typing import Any, Literal

from rollway.admin.client_transport import Transport, path_segment, query
from rollway.admin.client_types import RollwayAPIError, WeightUpdateFailed
from rollway.admin.model_schemas import UpdatePage
from rollway.store import WeightUpdate


class UpdatesMixin:
    """Weight updates of ``AsyncRollwayClient`` (which provides the transport)."""

    _t: Transport

    async def update_weights(
        self,
        alias: str,
        version: str | None = None,
        *,
        in_flight: Literal["drain", "abort"] = "drain",
        drain_timeout_seconds: float = 60.0,
        timeout_seconds: float = 600.0,
        weights_path: str | None = None,
        note: str | None = None,
    ) -> WeightUpdate:
        """Update ``alias``'s weights in place as one operation: its new calls held, its calls in flight drained
        (or aborted: ``in_flight="abort"``), each engine behind it reloaded (from ``weights_path`` when given),
        the alias given ``version`` (its version + 1 when None), resumed. ``WeightUpdateFailed`` (with the
        update's record) when an engine failed: the alias is then back on its old version."""
        body = {"in_flight": in_flight, "drain_timeout_seconds": drain_timeout_seconds}
        body |= {"timeout_seconds": timeout_seconds} | query(version=version, weights_path=weights_path, note=note)
        return await self._update(alias, body, wait=drain_timeout_seconds + 2 * timeout_seconds)

    async def begin_update(
        self,
        alias: str,
        version: str | None = None,
        *,
        in_flight: Literal["drain", "abort"] = "drain",
        drain_timeout_seconds: float = 60.0,
        timeout_seconds: float = 600.0,
        note: str | None = None,
    ) -> WeightUpdate:
        """The trainer form: hold ``alias`` and drain (or abort) its calls, for the trainer to move the weights
        itself; then ``commit_update`` (or ``abort_update``). Not committed within ``timeout_seconds``, the update
        expires and the alias resumes on its old version."""
        body = {"form": "trainer", "in_flight": in_flight, "drain_timeout_seconds": drain_timeout_seconds}
        body |= {"timeout_seconds": timeout_seconds} | query(version=version, note=note)
        return await self._update(alias, body, wait=drain_timeout_seconds)

    async def commit_update(self, update_id: str) -> WeightUpdate:
        """End an open update: the alias gets its new version and resumes."""
        return await self._ended("POST", f"/updates/{path_segment(update_id)}/commit")

    async def abort_update(self, update_id: str, reason: str | None = None) -> WeightUpdate:
        """End an open update on the old version."""
        return await self._ended("POST", f"/updates/{path_segment(update_id)}/abort", json=query(reason=reason))

    async def get_update(self, update_id: str) -> WeightUpdate:
        return await self._t.model(WeightUpdate, "GET", f"/updates/{path_segment(update_id)}")

    async def list_updates(self, alias: str | None = None, limit: int = 20) -> list[WeightUpdate]:
        """The latest weight updates (of ``alias``, when given), newest first."""
        page = await self._t.model(UpdatePage, "GET", "/updates", params=query(alias=alias, limit=limit))
        return page.items

    async def _update(self, alias: str, body: dict[str, Any], *, wait: float) -> WeightUpdate:
        return await self._ended("POST", f"/models/{path_segment(alias)}/updates", json=body, wait=wait)

    async def _ended(self, method: str, path: str, **options: Any) -> WeightUpdate:
        try:
            return await self._t.model(WeightUpdate, method, path, **options)
        except RollwayAPIError as exc:
            if exc.code == "weight_update_failed" and isinstance(exc.body, dict) and "update" in exc.body:
                raise WeightUpdateFailed(exc, WeightUpdate.model_validate(exc.body["update"])) from None
            raise
