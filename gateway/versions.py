"""The weight version each engine reports, checked against the version Rollway records for its calls.

The version on a span is a label: the alias's (or its backend's) version when the call was admitted. The engine
keeps its own (vLLM 0.32's ``GET /weight_info``, SGLang's ``GET /get_weight_version``), which a weight update
sets (``gateway.updates``). Between updates the two can part: an engine restarted, or reloaded by hand, or
started from weights another run left behind. ``VersionWatch`` asks every such engine, every ``interval``
seconds and after each update, and keeps what it found per alias and backend:

- ``match``: the engine reports the version Rollway records;
- ``mismatch``: it reports another one (its calls are recorded under a version the weights are not);
- ``unset``: it reports its initial ``default`` (it was never given a version: started afresh since);
- nothing, when the engine does not say (not in dev mode, not a vLLM or SGLang, or unreachable).

The dashboard's model page and ``GET /admin/v1/models/{alias}`` show it (``engine_versions``), and
``rollway_engine_version_mismatch{alias,backend}`` is 1 while an engine reports another version. An alias held
by an update is not checked: its engines are between versions on purpose.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from rollway.gateway.registry import ModelRegistry
from rollway.gateway.weights import RELOADABLE, EngineWeights
from rollway.store import ModelAlias, Store, StoreError

log = logging.getLogger("rollway.updates")

#: The version vLLM and SGLang report until they are given one.
ENGINE_DEFAULT = "default"

VersionState = Literal["match", "mismatch", "unset"]


@dataclass(frozen=True, slots=True)
class EngineVersion:
    reported: str
    expected: str
    state: VersionState
    checked_time: float


class VersionWatch:
    def __init__(self, store: Store, registry: ModelRegistry, engines: EngineWeights, interval: float) -> None:
        self._store, self._registry, self._engines = store, registry, engines
        self.interval = interval
        self._found: dict[str, dict[str, EngineVersion]] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.interval > 0 and self._task is None:
            self._task = asyncio.create_task(self._loop(), name="rollway-version-watch")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def of(self, alias: str) -> dict[str, EngineVersion]:
        """What the last check found for ``alias``'s engines, by backend id (those that say a version)."""
        return dict(self._found.get(alias, {}))

    def mismatches(self) -> Iterator[tuple[str, str, bool]]:
        """(alias, backend id, whether its engine reports another version), for the metrics."""
        for alias, found in self._found.items():
            for backend_id, seen in found.items():
                yield alias, backend_id, seen.state == "mismatch"

    async def check(self, model: ModelAlias) -> dict[str, EngineVersion]:
        """Ask each engine behind ``model`` for its version now, and keep what it says."""
        if model.update_id is not None:
            return self.of(model.alias)
        backends = [await self._registry.kinds.resolve(b) for b in model.backends]
        asked = [b for b in backends if b.kind in RELOADABLE]
        reported = await asyncio.gather(*(self._engines.version(b, b.kind) for b in asked))
        now = time.time()
        found: dict[str, EngineVersion] = {}
        for backend, version in zip(asked, reported, strict=True):
            if version is None:
                continue
            expected = backend.version or model.version
            state: VersionState = (
                "match" if version == expected else "unset" if version == ENGINE_DEFAULT else "mismatch"
            )
            before = self._found.get(model.alias, {}).get(backend.backend_id)
            if state == "mismatch" and (before is None or before.state != state):  # once, when it begins
                log.warning(
                    "engine version differs: alias=%s backend=%s engine=%s recorded=%s",
                    model.alias,
                    backend.backend_id,
                    version,
                    expected,
                )
            found[backend.backend_id] = EngineVersion(version, expected, state, now)
        self._found[model.alias] = found
        return found

    async def check_all(self) -> None:
        models = await self._store.list_models()
        self._found = {alias: v for alias, v in self._found.items() if alias in {m.alias for m in models}}
        await asyncio.gather(*(self.check(m) for m in models))

    async def check_alias(self, alias: str) -> None:
        """``check`` of ``alias`` as stored now (after an update ends); a failure is logged, not raised."""
        try:
            await self.check(await self._store.get_model(alias))
        except (StoreError, OSError) as exc:
            log.warning("engine version check of %s failed: %s", alias, exc)

    async def _loop(self) -> None:
        while True:
            try:
                await self.check_all()
            except (StoreError, OSError) as exc:  # the store is down, say: the next round tries again
                log.warning("engine version check failed: %s", exc)
            await asyncio.sleep(self.interval)  # a period, not synchronisation
