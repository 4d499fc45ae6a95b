"""``create_app(settings)``: the one ASGI application, ``RollwayApp``. The data plane (``rollway.gateway``) sits in
front of a FastAPI app, which serves the control plane (``rollway.admin``), Agent-lightning's routes
(``rollway.agl``), the Osmosis routes (``rollway.osmosis``) and the probes, behind the request guards. The two are
composed, not fused: LLM calls never pass through the framework's error, telemetry and body-limit layers (the data
plane has its own), the rest of the API does.

The lifespan owns everything long-lived: the store (its writer, watchdog and heartbeat), the backend connections,
the model registry, the Osmosis dispatcher, the replica report and the span exporter; nothing is created at
import.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, MutableMapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

from rollway.admin.api import build_router as admin_router
from rollway.admin.context import AdminContext
from rollway.agl.access import PathToken
from rollway.agl.routes import build_router as agl_router
from rollway.agl.routes import build_traces_router
from rollway.agl.server import DetailError, detail_error, key_accepted
from rollway.agl.server import build_router as agl_server_router
from rollway.app import errors, probes
from rollway.app.connections import CONNECTIONS_REFUSED
from rollway.app.guards import BodyLimit, HostOriginGuard
from rollway.app.replicas import ReplicaReporter, new_replica
from rollway.app.state import AppState
from rollway.gateway.attribution import KeyCache
from rollway.gateway.controlled import ControlledProxy
from rollway.gateway.dataplane import DataPlane, Serving
from rollway.gateway.metrics import Metrics
from rollway.gateway.proxy import Gateway
from rollway.gateway.registry import ModelRegistry
from rollway.gateway.routing import Router
from rollway.gateway.updates import WeightUpdates
from rollway.osmosis import agents as osmosis_agents
from rollway.osmosis import callbacks as osmosis
from rollway.osmosis.dispatcher import Dispatcher
from rollway.settings import Settings
from rollway.store import ConflictError, NotFoundError, Store, StoreValidationError, UnavailableError
from rollway.ui.routes import build_router as ui_router

if TYPE_CHECKING:
    from rollway.gateway.otlp_export import SpanExporter

log = logging.getLogger("rollway.gateway")
#: How long the lifespan's shutdown waits for the calls the server cancelled to write their spans.
CALLS_END_GRACE = 5.0


class RollwayApp:
    """The ASGI application: ``HostOriginGuard`` in front of the data plane (``DataPlane``), which serves the LLM
    calls itself and hands every other request, and the lifespan, to the FastAPI app (``api``)."""

    def __init__(self, api: FastAPI, dataplane: DataPlane, settings: Settings) -> None:
        self.api = api
        self.dataplane = dataplane
        self._stack = HostOriginGuard(dataplane, settings)
        #: Why the lifespan could not start, when it is something the user can fix (``create_app``'s lifespan).
        self.startup_error: str | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            send = self._startup_failure_in_words(send)
        await self._stack(scope, receive, send)

    @property
    def state(self) -> AppState:
        """The running application's long-lived objects (the lifespan's)."""
        state: AppState | None = getattr(self.api.state, "rollway", None)
        if state is None:
            raise RuntimeError("the application is not running (its lifespan has not started)")
        return state

    def lifespan(self) -> AbstractAsyncContextManager[Any]:
        """The lifespan, to run the app in process (tests, ``httpx.ASGITransport``) without an ASGI server."""
        return self.api.router.lifespan_context(self.api)

    def _startup_failure_in_words(self, send: Send) -> Send:
        """The server's start failing on a store that cannot be opened (a SQLite file in a directory that does
        not exist, PostgreSQL unreachable) is reported as that one sentence: Starlette would hand uvicorn the
        traceback to log, 80 lines of SQLAlchemy around it."""

        async def send_in_words(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "lifespan.startup.failed" and self.startup_error is not None:
                message = {**message, "message": f"rollway: {self.startup_error}"}
            await send(message)

        return send_in_words


def create_app(settings: Settings) -> RollwayApp:
    @asynccontextmanager
    async def lifespan(api: FastAPI) -> AsyncIterator[dict[str, Any]]:
        try:
            store = await Store.open(
                settings.database_url,
                sqlite_synchronous=settings.sqlite_synchronous,
                pg_pool_size=settings.pg_pool_size,
                watchdog_interval=settings.watchdog_interval,
                secret_key=settings.secret_key.get_secret_value() if settings.secret_key else None,
            )
        except (UnavailableError, StoreValidationError) as exc:
            app.startup_error = exc.message
            raise
        await seed_models(store, settings)
        replica = new_replica()
        registry = ModelRegistry(store, replica_id=replica.replica_id)
        router = Router()
        metrics = Metrics()
        metrics.attach(store, router)
        exporter: SpanExporter | None = None
        if settings.otlp_export_endpoint:
            from rollway.gateway.otlp_export import SpanExporter  # protobuf only when exporting

            exporter = SpanExporter(
                settings.otlp_export_endpoint,
                metrics,
                queue_size=settings.otlp_export_queue,
                batch_size=settings.otlp_export_batch,
                interval=settings.otlp_export_interval,
                timeout=settings.otlp_export_timeout,
            )
            await exporter.start()
        gateway = Gateway(settings, store, registry, router, metrics, exporter)
        await gateway.start()
        keys = KeyCache(store)
        store.key_observer = keys.prime  # the keys this process's claims mint, known to its gateway at once
        registry.listen(keys.forget)  # the catalog changed (a key revoked through another replica, maybe)
        registry.listen(metrics.catalog_changes.inc)
        dispatcher = Dispatcher(settings, store)
        await dispatcher.start()
        updates = WeightUpdates(store, registry, metrics, version_check_interval=settings.version_check_interval)
        updates.versions.start()
        metrics.engine_versions = updates.versions.mismatches
        reporter = ReplicaReporter(store, registry, replica, follow=updates.follow)
        await reporter.start()
        temperatures = {"train": settings.agl_train_temperature, "val": settings.agl_val_temperature}
        # The proxy route takes the keys the /api/* routes take, looked up through the data plane's key cache.
        accepts = functools.partial(key_accepted, admin_token=settings.admin_token, find_key=keys.find)
        proxy = ControlledProxy(store, accepts, settings.agl_model, temperatures)
        registry.listen(proxy.forget)  # a pause or models changed through another replica
        api.state.rollway = AppState(
            settings=settings,
            store=store,
            registry=registry,
            router=router,
            gateway=gateway,
            keys=keys,
            metrics=metrics,
            dispatcher=dispatcher,
            reporter=reporter,
        )
        api.state.admin = AdminContext(
            store=store,
            models=registry,
            updates=updates,
            keys=keys,
            admin_token=settings.admin_token,
            public_url=settings.public_url,
            backend_up=router.is_up,
            engine_versions=updates.versions.of,
            proxy_changed=proxy.forget,
            groups_exported=metrics.count_exported_group,
        )
        dataplane.serve_with(Serving(gateway, keys, proxy))
        try:
            # The lifespan state, which the server's connections see too: they count their refusals.
            yield {CONNECTIONS_REFUSED: metrics.count_refused_connection}
        finally:
            # Calls still running were cancelled by the server's shutdown: their spans are written first.
            if not await gateway.running.wait_for_none(CALLS_END_GRACE):
                log.warning("calls still running at shutdown after %s s: their spans may be lost", CALLS_END_GRACE)
            dataplane.serve_with(None)
            await reporter.close()  # logs, never raises
            await updates.close()
            await dispatcher.close()
            await gateway.close()
            await registry.kinds.close()
            if exporter is not None:
                await exporter.close()
            await store.close()
            metrics.close()

    # /docs and /redoc load their scripts from a CDN when opened: served only when asked for (ROLLWAY_API_DOCS).
    docs = settings.api_docs
    api = FastAPI(
        title="Rollway",
        version=_version(),
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
    )
    errors.install(api)
    api.include_router(admin_router(extra=[osmosis_agents.router]))
    api.include_router(probes.build_router())
    api.include_router(agl_router())
    api.include_router(agl_server_router())  # Agent-lightning 1.0's server API, at the root
    api.add_exception_handler(DetailError, detail_error)
    api.include_router(build_traces_router())
    api.include_router(osmosis.router)
    api.include_router(ui_router())  # the dashboard's pages (/ui); their data comes through /admin/v1
    api.add_middleware(BodyLimit, settings=settings)  # the data plane has its own
    # /t/<admin token>/v1/agl/... and /t/<admin token>/v1/traces
    api.add_middleware(PathToken, admin_token=settings.admin_token)
    dataplane = DataPlane(api)
    app = RollwayApp(api, dataplane, settings)
    return app


async def seed_models(store: Store, settings: Settings) -> None:
    """Create the configuration's model aliases the store does not have (a restart changes no live alias)."""
    for alias, seed in settings.models.items():
        try:
            await store.get_model(alias)
        except NotFoundError:
            try:
                await store.put_model(alias, seed.backends, version=seed.version, sampling=seed.sampling)
            except ConflictError:  # another replica starting at the same moment created it
                continue
            log.info("model alias %s created from the configuration", alias)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rollway")
    except PackageNotFoundError:
        return "0+unknown"
