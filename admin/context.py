"""What the admin routes need from the running server, as a small typed object on the app state.

``rollway.admin`` does not import ``rollway.gateway``: the composition root (``rollway/app/factory.py``) builds an
``AdminContext`` and hands in the gateway's alias registry through the ``ModelControl`` protocol.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Protocol

from fastapi import Depends, Request
from pydantic import SecretStr

from rollway.store import Backend, ModelAlias, Store
from rollway.store.schemas import UpdatePlan, WeightUpdate


class ModelControl(Protocol):
    """Model aliases, stored and live (pause gate, in-flight counts, atomic swap), owned by the gateway: each
    admin route on models is one call of it."""

    async def put(
        self,
        alias: str,
        backends: Sequence[Backend],
        *,
        version: str | None = None,
        sampling: dict[str, Any] | None = None,
    ) -> ModelAlias:
        """Create or replace ``alias``, install it for new calls and detect its ``auto`` backends' engines."""
        ...

    async def swap(
        self,
        alias: str,
        backends: Sequence[Backend] | None = None,
        *,
        version: str | None = None,
        drain_timeout: float | None = None,
    ) -> tuple[ModelAlias, bool | None]:
        """New backends and/or version for new calls; with ``drain_timeout``, whether the old calls drained."""
        ...

    async def delete(self, alias: str) -> None: ...

    async def pause(self, alias: str) -> ModelAlias: ...

    def install(self, alias: str, config: ModelAlias) -> None:
        """Apply a configuration another route changed in the store (the proxy's pause) to new calls at once, and
        wake the calls waiting on the alias if it resumed."""
        ...

    async def resume(self, alias: str) -> ModelAlias: ...

    async def drain(self, alias: str, timeout: float, *, old_only: bool = False) -> bool: ...

    async def in_flight_everywhere(
        self, models: list[ModelAlias], *, since: int | None = None
    ) -> dict[str, tuple[int, int]]:
        """Per alias: calls in flight in every replica, and those of them on an earlier configuration; with
        ``since`` (a catalog revision), a replica not heard from since it (or reports unread) counts as one."""
        ...

    def detected_kinds(self) -> dict[str, str]:
        """Backend id → the kind detected for it, for the ``auto`` backends this process has asked."""
        ...

    async def reachable(self, backends: list[Backend]) -> dict[str, bool]:
        """Backend id → whether its address accepts a connection now (tried at most every few seconds)."""
        ...

    def capture(self, alias: str) -> CaptureCounts:
        """The alias's completions in this process, and how many of them had no token ids."""
        ...


class UpdateControl(Protocol):
    """The weight-update operation (``rollway.gateway.updates.WeightUpdates``)."""

    async def run(self, alias: str, plan: UpdatePlan, by: str) -> WeightUpdate: ...

    async def begin(self, alias: str, plan: UpdatePlan, by: str) -> WeightUpdate: ...

    async def commit(self, update_id: str) -> WeightUpdate: ...

    async def abort(self, update_id: str, reason: str | None = None) -> WeightUpdate: ...


class EngineVersion(Protocol):
    """What an engine reported as its weight version (``rollway.gateway.versions.EngineVersion``)."""

    @property
    def reported(self) -> str: ...
    @property
    def expected(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def checked_time(self) -> float: ...


class CaptureCounts(Protocol):
    completions: int
    untrainable: int
    without_logprobs: int


class KeyCacheControl(Protocol):
    def forget(self, key_id: str | None = None) -> None: ...


@dataclass
class AdminContext:
    store: Store
    models: ModelControl
    updates: UpdateControl
    keys: KeyCacheControl
    admin_token: SecretStr | None = None
    public_url: str | None = None
    started: float = field(default_factory=time.time)
    #: Whether this process routes calls to a backend now (the gateway's passive health: False while it is ejected
    #: after failures), by backend id; None when the server does not say (backends are then shown as unknown).
    backend_up: Callable[[str], bool] | None = None
    #: What each engine behind an alias last reported as its weight version (``gateway.versions``), by backend.
    engine_versions: Callable[[str], Mapping[str, EngineVersion]] | None = None
    #: Tells the data plane's controlled proxy that its pause or its models changed (``gateway.controlled``).
    proxy_changed: Callable[[], None] = lambda: None
    #: Counts a complete group an export handed out, by its health (``admin.groups.verdict``).
    groups_exported: Callable[[str], None] = lambda verdict: None


def context_of(request: Request) -> AdminContext:
    context: AdminContext = request.app.state.admin
    return context


async def get_context(request: Request) -> AdminContext:
    """The dependency: ``async`` because FastAPI runs a plain ``def`` dependency in a worker thread, a thread
    hop on every admin and Agent-lightning request."""
    return context_of(request)


Context = Annotated[AdminContext, Depends(get_context)]
