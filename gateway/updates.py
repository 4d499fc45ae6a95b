"""A weight update as one operation: hold an alias's new calls, drain or abort the calls in flight, let the
weights change, give the alias the new version, resume.

Two forms:
- ``reload`` (``WeightUpdates.run``): Rollway asks each engine behind the alias to reload in place
  (``gateway.weights``) and commits when every one did; a failure resumes on the old version, and a backend that
  did take the new weights when another failed is recorded under the new version from then on (its own version
  on the alias, until the next update commits).
- ``trainer`` (``begin``, then ``commit`` or ``abort``): the trainer moves the weights itself (NCCL, CUDA IPC,
  its own reload) while the alias is held. An update not committed by its deadline expires: resumed on the old
  version, and its record says so.

The hold is the store's (``store.sql.updates``): the alias is paused and names the update in one transaction, and
every replica holds its calls from its next call on (the catalog revision moves). Calls held wait until the
update ends, past ``ROLLWAY_PAUSE_WAIT_SECONDS`` if it takes longer (the alias's ``hold_until``). A drain counts
the calls of every replica (``ModelRegistry.drain``); an abort ends this process's calls at once and each other
replica's at its next look (``follow``, from its replica reporter). Every update is recorded, ended exactly once
(the store ends only an open update) and counted in the metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Collection, Coroutine
from typing import Any

from rollway.gateway.metrics import Metrics
from rollway.gateway.registry import ModelRegistry
from rollway.gateway.versions import VersionWatch
from rollway.gateway.weights import RELOADABLE, EngineWeights, Reload
from rollway.store import ConflictError, Store, StoreError, StoreValidationError
from rollway.store.schemas import EngineStep, UpdateForm, UpdatePlan, UpdateState, WeightUpdate

log = logging.getLogger("rollway.updates")

#: How long after its deadline an open update is expired by any replica (its own replica does it on time).
EXPIRY_GRACE = 1.0


class WeightUpdates:
    def __init__(
        self,
        store: Store,
        registry: ModelRegistry,
        metrics: Metrics,
        engines: EngineWeights | None = None,
        *,
        version_check_interval: float = 0.0,
    ) -> None:
        self._store = store
        self._registry = registry
        self._metrics = metrics
        self.engines = engines or EngineWeights()
        #: The engines' own versions, checked every ``version_check_interval`` s and after each update.
        self.versions = VersionWatch(store, registry, self.engines, version_check_interval)
        self._expiries: dict[str, asyncio.TimerHandle] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        await self.versions.close()
        for handle in self._expiries.values():
            handle.cancel()
        self._expiries.clear()
        for task in list(self._tasks):
            task.cancel()
        await self.engines.close()

    # -- the two forms -----------------------------------------------------------------------------------

    async def run(self, alias: str, plan: UpdatePlan, by: str) -> WeightUpdate:
        """The ``reload`` form, whole: its record as it ended (``committed`` or ``failed``)."""
        model = await self._store.get_model(alias)
        kinds = {b.backend_id: (await self._registry.kinds.resolve(b)).kind for b in model.backends}
        if wrong := {backend: kind for backend, kind in kinds.items() if kind not in RELOADABLE}:
            listed = ", ".join(f"'{b}' ({k})" for b, k in wrong.items())
            raise StoreValidationError(  # nothing was held: a 400
                f"model '{alias}': Rollway cannot reload backend {listed} in place (it can reload vllm and "
                "sglang engines): update in the trainer form (begin, move the weights, commit)"
            )
        hold = plan.drain_timeout + plan.timeout + EXPIRY_GRACE
        update = await self._hold(alias, plan, "reload", by, hold)
        if update.state != "open":
            return update
        reloads = await asyncio.gather(
            *(
                self.engines.reload(b, kinds[b.backend_id], update.to_version, plan.weights_path, plan.timeout)
                for b in model.backends
            )
        )
        steps = [step for done in reloads for step in done.steps]
        versions = {done.backend_id: done.version for done in reloads}
        error = _reload_error(reloads, update.to_version)
        if error is None:
            return await self._end(update, "committed", steps=steps, engine_versions=versions)
        took = _took(reloads, update.to_version)
        return await self._end(update, "failed", error=error, steps=steps, engine_versions=versions, relabel=took)

    async def begin(self, alias: str, plan: UpdatePlan, by: str) -> WeightUpdate:
        """The ``trainer`` form's begin: the alias held and its calls drained (or aborted); the update ``open``
        until ``commit`` or ``abort``, or expired ``plan.timeout`` seconds from now."""
        update = await self._hold(alias, plan, "trainer", by, plan.drain_timeout + plan.timeout)
        if update.state == "open":  # the trainer's time counts from now, when the alias is drained
            update = await self._store.record_update(update.update_id, deadline=time.time() + plan.timeout)
            self._expiries[update.update_id] = asyncio.get_running_loop().call_later(
                plan.timeout, self._spawn_expiry, update.update_id
            )
        return update

    async def commit(self, update_id: str) -> WeightUpdate:
        """End an open update with its new version; what the engines report of their weight version is noted."""
        update = await self._store.get_update(update_id)
        versions = await self._versions(update.alias) if update.state == "open" else {}
        return await self._end(update, "committed", engine_versions=versions)

    async def abort(self, update_id: str, reason: str | None = None) -> WeightUpdate:
        """End an open update on its old version."""
        update = await self._store.get_update(update_id)
        return await self._end(update, "aborted", error=reason or "aborted by the caller")

    # -- replicas ------------------------------------------------------------------------------------------

    async def follow(self) -> None:
        """What every replica does for updates begun anywhere (its reporter calls this when the catalog moved and
        at each heartbeat): end its own calls of an alias whose open update aborts them, and expire open updates
        past their deadline (one whose replica is gone)."""
        opened = await self._store.open_updates()
        now = time.time()
        for update in opened:
            if update.in_flight == "abort" and (ended := self._registry.abort(update.alias, _abort_reason(update))):
                with contextlib.suppress(StoreError):  # (its spans say so whatever the count)
                    await self._store.count_aborted_calls(update.update_id, ended)
            if now > update.deadline + EXPIRY_GRACE:
                with contextlib.suppress(ConflictError):  # ended meanwhile
                    await self._expire(update)

    # -- steps -----------------------------------------------------------------------------------------

    async def _hold(self, alias: str, plan: UpdatePlan, form: UpdateForm, by: str, hold: float) -> WeightUpdate:
        """Begin: the alias held, then its calls in flight drained or aborted. An update whose calls did not end
        within the drain's bound ends ``failed`` (resumed on the old version) and is returned so."""
        update = await self._store.begin_update(
            alias,
            to_version=plan.to_version,
            form=form,
            in_flight=plan.in_flight,
            by=by,
            note=plan.note,
            timeout=hold,
        )
        log.info(
            "weight update %s of %s: %s → %s (%s)",
            update.update_id,
            alias,
            update.from_version,
            update.to_version,
            form,
        )
        try:
            self._registry.install(alias, await self._store.get_model(alias))  # held here from now on
            if plan.in_flight == "abort" and (aborted := self._registry.abort(alias, _abort_reason(update))):
                with contextlib.suppress(StoreError):  # the count only: the calls are ended, their spans say so
                    await self._store.count_aborted_calls(update.update_id, aborted)  # other replicas add theirs
            drained = await self._registry.drain(alias, plan.drain_timeout)
        except BaseException as exc:
            with contextlib.suppress(StoreError, ConflictError):
                await self._end(update, "failed", error=f"the update's hold failed: {type(exc).__name__}")
            raise
        update = await self._store.record_update(update.update_id, drained=drained)
        if not drained:
            left = self._registry.in_flight(alias)
            error = f"calls still in flight after {plan.drain_timeout:g} s ({left} here); nothing was changed"
            return await self._end(update, "failed", error=error)
        return update

    async def _end(
        self,
        update: WeightUpdate,
        state: UpdateState,
        *,
        error: str | None = None,
        steps: list[EngineStep] | None = None,
        engine_versions: dict[str, str | None] | None = None,
        relabel: Collection[str] = (),
    ) -> WeightUpdate:
        values: dict[str, object] = {}
        if steps is not None:
            values["steps"] = steps
        if engine_versions is not None:
            values["engine_versions"] = engine_versions
        ended = await self._store.finish_update(update.update_id, state, error=error, relabel=relabel, **values)
        if (handle := self._expiries.pop(update.update_id, None)) is not None:
            handle.cancel()
        with contextlib.suppress(StoreError):
            self._registry.install(ended.alias, await self._store.get_model(ended.alias))  # resumed here at once
        self._metrics.observe_update(ended.alias, ended.state, ended.held_seconds, ended.aborted_calls)
        self._spawn(self.versions.check_alias(ended.alias))  # what the engines say now, not at the next round
        level = logging.INFO if state == "committed" else logging.WARNING
        log.log(
            level,
            "weight update %s of %s %s%s",
            ended.update_id,
            ended.alias,
            ended.state,
            f": {error}" if error else "",
        )
        return ended

    def _spawn_expiry(self, update_id: str) -> None:
        self._expiries.pop(update_id, None)
        self._spawn(self._expire_id(update_id))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _expire_id(self, update_id: str) -> None:
        try:
            update = await self._store.get_update(update_id)
            if update.state == "open":
                await self._expire(update)
        except (ConflictError, StoreError) as exc:  # ended meanwhile, or the store is down (a replica retries)
            log.info("weight update %s not expired here: %s", update_id, exc)

    async def _expire(self, update: WeightUpdate) -> None:
        held = update.deadline - update.begun_time
        await self._end(update, "expired", error=f"not committed within {held:g} s; resumed on the old version")

    async def _versions(self, alias: str) -> dict[str, str | None]:
        """What each engine behind ``alias`` reports as its weight version (engines that say one)."""
        model = await self._store.get_model(alias)
        backends = [await self._registry.kinds.resolve(b) for b in model.backends]
        found = await asyncio.gather(*(self.engines.version(b, b.kind) for b in backends))
        return {b.backend_id: v for b, v in zip(backends, found, strict=True) if b.kind in RELOADABLE}


def _abort_reason(update: WeightUpdate) -> str:
    return f"model '{update.alias}' is updating its weights ({update.from_version} → {update.to_version})"


def _took(reloads: list[Reload], to_version: str) -> list[str]:
    """The backends that took the new weights (reloaded, and report the new version or none), in an update that
    failed on another: they keep serving them, so their calls are recorded under the new version."""
    return [done.backend_id for done in reloads if done.error is None and done.version in (None, to_version)]


def _reload_error(reloads: list[Reload], to_version: str) -> str | None:
    """Why a reload failed: an engine call that failed, or an engine that reports another version after it."""
    errors = [done.error for done in reloads if done.error]
    errors += [
        f"backend '{done.backend_id}' reports weight version '{done.version}' after the reload, not '{to_version}'"
        for done in reloads
        if done.error is None and done.version is not None and done.version != to_version
    ]
    if not errors:
        return None
    took = _took(reloads, to_version)
    tail = (
        f"; backends {', '.join(took)} took the new weights and are recorded as '{to_version}' until the next update"
        if took
        else ""
    )
    return "; ".join(errors) + "; the alias resumed on the old version" + tail
