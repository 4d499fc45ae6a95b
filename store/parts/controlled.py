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
from rollway.store.schemas import ModelAlias
from rollway.store.sql import catalog, controlled, proxy


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

    async def put_engine_models(self, models: list[EngineModel]) -> list[ModelAlias]:
        """Register endpoints; while the proxy is paused, the models' aliases are held by its pause (those it
        paused are returned, for the caller's registry to install)."""
        now = self.clock()

        def op(conn: Any) -> list[ModelAlias]:
            return self._aliases(conn, proxy.put_models(conn, models, now))

        return await self._write(op)

    async def delete_engine_models(self) -> None:
        await self._write(proxy.delete_models)

    async def engine_models(self) -> list[EngineModel]:
        return await self._read(proxy.engine_models)

    async def proxy_pause(self) -> ProxyPause:
        return await self._read(proxy.pause)

    async def pause_proxy(self, retry_after_seconds: int, reason: str | None) -> tuple[ProxyPause, list[ModelAlias]]:
        """Pause the proxy and the registered models' aliases not paused yet (``store.sql.proxy.hold``), in one
        transaction; the catalog revision moves, so other replicas reload what they cached. The pause and the
        aliases it paused."""
        now = self.clock()

        def op(conn: Any) -> tuple[ProxyPause, list[ModelAlias]]:
            paused = proxy.pause_proxy(conn, retry_after_seconds, reason, now)
            return proxy.pause(conn), self._aliases(conn, paused)

        return await self._write(op)

    async def resume_proxy(self) -> tuple[ProxyPause, list[ModelAlias]]:
        """End the proxy's pause and resume the aliases it holds, in one transaction: the pause and the aliases
        resumed."""
        now = self.clock()

        def op(conn: Any) -> tuple[ProxyPause, list[ModelAlias]]:
            resumed = proxy.resume_proxy(conn, now)
            return proxy.pause(conn), self._aliases(conn, resumed)

        return await self._write(op)

    def _aliases(self, conn: Any, names: list[str]) -> list[ModelAlias]:
        return [catalog.get_model(conn, name, self.cipher) for name in names]
