"""The resources, model-alias, API-key and gateway-replica part of ``Store``: a mixin over the same plumbing (each
one read or one write operation)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rollway.store.parts.plumbing import StorePlumbing
from rollway.store.replicas import ReplicaInfo, ReplicaReport
from rollway.store.schemas import ApiKey, AttemptedRollout, Backend, KeyScope, ModelAlias, Page, ResourcesUpdate
from rollway.store.sql import catalog, keys, proxy, replicas, resources


class CatalogMixin(StorePlumbing):
    # -- resources --------------------------------------------------------------------------------------

    async def add_resources(self, named: dict[str, Any]) -> ResourcesUpdate:
        now = self.clock()
        return await self._write(lambda conn: resources.add(conn, named, now))

    async def update_resources(
        self, resources_id: str, named: dict[str, Any], *, create: bool = True
    ) -> ResourcesUpdate:
        """A new version (+1) of the bundle; a new ``resources_id`` makes version 1, or with ``create=False`` is
        a ``NotFoundError``."""
        now = self.clock()
        return await self._write(lambda conn: resources.update(conn, resources_id, named, now, create=create))

    async def get_resources(self, resources_id: str) -> ResourcesUpdate:
        return await self._read(lambda conn: resources.get(conn, resources_id))

    async def latest_resources(self) -> ResourcesUpdate | None:
        return await self._read(resources.latest)

    async def list_resources(self, limit: int = 100, cursor: str | None = None) -> Page[ResourcesUpdate]:
        return await self._read(lambda conn: resources.page(conn, limit, cursor))

    # -- models and keys --------------------------------------------------------------------------------

    async def put_model(
        self,
        alias: str,
        backends: Sequence[Backend | Mapping[str, Any]],
        *,
        version: str | None = None,
        sampling: dict[str, Any] | None = None,
    ) -> ModelAlias:
        """Create or replace ``alias``; a registered model's alias created while the proxy is paused is held by
        its pause (``store.sql.proxy.holds_new``), as those it paused are; an alias of no registered model is
        not."""
        parsed = [b if isinstance(b, Backend) else Backend.model_validate(b) for b in backends]
        now = self.clock()

        def op(conn: Any) -> ModelAlias:
            held = proxy.holds_new(conn, alias)
            model = catalog.put_model(conn, alias, parsed, version, sampling, now, self.cipher)
            if held and proxy.hold(conn, [alias], now):
                model = catalog.get_model(conn, alias, self.cipher)
            return model

        return await self._write(op)

    async def get_model(self, alias: str) -> ModelAlias:
        return await self._read(lambda conn: catalog.get_model(conn, alias, self.cipher))

    async def list_models(self) -> list[ModelAlias]:
        return await self._read(lambda conn: catalog.list_models(conn, self.cipher))

    async def delete_model(self, alias: str) -> None:
        await self._write(lambda conn: catalog.delete_model(conn, alias))

    async def catalog_revision(self) -> int:
        """Moves forward with every change to model aliases or API keys (see ``catalog.REVISION``)."""
        return await self._read(catalog.revision)

    async def set_model_paused(self, alias: str, paused: bool) -> ModelAlias:
        """An admin's pause or resume: the alias is no longer one the proxy's pause holds
        (``store.sql.proxy.release``), so the proxy's resume leaves it as this leaves it."""
        now = self.clock()

        def op(conn: Any) -> ModelAlias:
            proxy.release(conn, alias, now)
            return catalog.set_paused(conn, alias, paused, now, self.cipher)

        return await self._write(op)

    async def mint_key(
        self,
        scope: KeyScope = "gateway",
        *,
        name: str | None = None,
        rollout_id: str | None = None,
        attempt_id: str | None = None,
        expires_time: float | None = None,
    ) -> tuple[ApiKey, str]:
        now = self.clock()
        return await self._write(
            lambda conn: keys.mint_key(
                conn,
                scope,
                now,
                name=name,
                rollout_id=rollout_id,
                attempt_id=attempt_id,
                expires_time=expires_time,
            )
        )

    async def mint_attempt_key(self, handed: AttemptedRollout, *, arrived: float | None = None) -> str:
        """A rollout-scoped key for an attempt a start handed out. ``arrived``: when the start arrived, if it
        carried an idempotency key: the keys an earlier try of it got for the attempt are revoked
        (``keys.attempt_keys``)."""
        now = self.clock()
        [minted] = await self._write(lambda conn: keys.attempt_keys(conn, [handed], now, arrived=arrived))
        self._keys_minted([minted])
        return minted[1]

    async def find_key(self, plain: str) -> ApiKey | None:
        now = self.clock()
        return await self._read(lambda conn: keys.find_key(conn, plain, now))

    async def revoke_key(self, key_id: str) -> ApiKey:
        now = self.clock()
        return await self._write(lambda conn: keys.revoke_key(conn, key_id, now))

    # -- gateway replicas -------------------------------------------------------------------------------

    async def report_replica(self, info: ReplicaInfo, snapshot: Callable[[], Mapping[str, Mapping[str, int]]]) -> int:
        """Write this gateway process's calls in flight (``snapshot`` is called inside the transaction, after
        the catalog revision was read — see ``store.sql.replicas``); the revision it was written under."""
        now = self.clock()
        return await self._write(lambda conn: replicas.report(conn, info, snapshot, now))

    async def live_replicas(self, *, exclude: str | None = None) -> list[ReplicaReport]:
        """The last reports of the gateway processes still alive (but ``exclude``)."""
        now = self.clock()
        return await self._read(lambda conn: replicas.live(conn, now, exclude=exclude))

    async def leave_replica(self, replica_id: str) -> None:
        await self._write(lambda conn: replicas.leave(conn, replica_id))
