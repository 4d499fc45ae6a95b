"""The controlled-rollouts part of ``Store`` (``store.sql.controlled``): rollouts an outside controller drives,
their events, and the models and pause of the proxy their agents call through."""

from __future__ import annotations

from typing import Any

from rollway.store.controlled import (
    ControlledCreate,
    ControlledPatch,
    ControlledRollout,
    EngineModel,
    ProxyPause,
    TerminalPage,
    View,
)
from rollway.store.db import limits
from rollway.store.parts.plumbing import StorePlumbing
from rollway.store.sql import catalog, controlled


class ControlledMixin(StorePlumbing):
    async def create_controlled(self, items: list[ControlledCreate]) -> list[ControlledRollout]:
        """Create rollouts for a controller, idempotently per ``rollout_id``."""
        for item in items:
            limits.check_task(item)
        now = self.clock()
        return await self._write(lambda conn: controlled.create(conn, items, now))

    async def get_controlled(self, rollout_id: str) -> tuple[ControlledRollout, list[str]]:
        """A controlled rollout and the controller's attempt ids that have events."""

        def op(conn: Any) -> tuple[ControlledRollout, list[str]]:
            return controlled.get(conn, rollout_id), controlled.attempt_labels(conn, rollout_id)

        return await self._read(op)

    async def controlled_live(self, rollout_id: str) -> bool:
        return await self._read(lambda conn: controlled.live(conn, rollout_id))

    async def list_controlled(self, views: set[View], limit: int) -> list[ControlledRollout]:
        return await self._read(lambda conn: controlled.listing(conn, views, limit))

    async def patch_controlled(self, rollout_id: str, change: ControlledPatch) -> ControlledRollout:
        """A controller's change, with its transition applied to the rollout and its attempt in one transaction."""
        now = self.clock()
        result = await self._write(lambda conn: controlled.patch(conn, rollout_id, change, now))
        self._notify_all()
        return result

    async def delete_controlled(self, rollout_id: str) -> None:
        now = self.clock()
        await self._write(lambda conn: controlled.remove(conn, rollout_id, now))

    async def terminal_controlled(self, after: int, limit: int) -> TerminalPage:
        items, next_after, total = await self._read(lambda conn: controlled.terminal(conn, after, limit))
        return TerminalPage(items=items, next_after=next_after, total=total)

    async def add_controlled_event(
        self, rollout_id: str, attempt_label: str, event_type: str, data: dict[str, Any]
    ) -> float:
        """Keep a posted event; its timestamp."""
        now = self.clock()
        await self._write(lambda conn: controlled.add_event(conn, rollout_id, attempt_label, event_type, data, now))
        return now

    async def put_engine_models(self, models: list[EngineModel]) -> None:
        now = self.clock()
        await self._write(lambda conn: controlled.put_models(conn, models, now))

    async def delete_engine_models(self) -> None:
        await self._write(controlled.delete_models)

    async def engine_models(self) -> list[EngineModel]:
        return await self._read(controlled.engine_models)

    async def proxy_pause(self) -> ProxyPause:
        return await self._read(controlled.pause)

    async def set_proxy_pause(self, state: ProxyPause) -> ProxyPause:
        """Keep the proxy's pause; the catalog revision moves, so other replicas reload what they cached."""
        now = self.clock()

        def op(conn: Any) -> ProxyPause:
            saved = controlled.set_pause(conn, state, now)
            catalog.bump_revision(conn)
            return saved

        return await self._write(op)
