"""``create_app(settings)``: the one FastAPI application (data plane, and the control plane as it lands).

The lifespan owns everything long-lived: the store (its writer and watchdog). Nothing is created at import.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from admin.api import build_router as admin_router
from admin.context import AdminContext
from gateway import errors, osmosis
from gateway.attribution import KeyCache
from gateway.dataplane import DataPlane
from gateway.dispatcher import Dispatcher
from gateway.proxy import Gateway
from gateway.registry import ModelRegistry
from gateway.routing import Router
from gateway.settings import Settings
from store import Store


@dataclass
class AppState:
    settings: Settings
    store: Store
    registry: ModelRegistry
    router: Router
    gateway: Gateway
    keys: KeyCache
    dispatcher: Dispatcher


def get_state(request: Request) -> AppState:
    state: AppState = request.app.state.rollway
    return state


State = Annotated[AppState, Depends(get_state)]


def create_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = await Store.open(
            settings.database_url,
            sqlite_synchronous=settings.sqlite_synchronous,
            watchdog_interval=settings.watchdog_interval,
        )
        registry = ModelRegistry(store)
        router = Router()
        gateway = Gateway(settings, store, registry, router)
        await gateway.start()
        keys = KeyCache(store)
        dispatcher = Dispatcher(settings, store)
        await dispatcher.start()
        app.state.rollway = AppState(
            settings=settings,
            store=store,
            registry=registry,
            router=router,
            gateway=gateway,
            keys=keys,
            dispatcher=dispatcher,
        )
        app.state.admin = AdminContext(
            store=store, models=registry, keys=keys, admin_token=settings.admin_token, public_url=settings.public_url
        )
        try:
            yield
        finally:
            await dispatcher.close()
            await gateway.close()
            await store.close()

    app = FastAPI(title="Rollway", version=_version(), lifespan=lifespan)
    errors.install(app)
    app.include_router(admin_router())
    app.include_router(osmosis.router)
    app.add_middleware(DataPlane)

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:
        """The process is alive."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"], response_model=None)
    async def readyz(state: State) -> Any:
        """The store answers."""
        try:
            await state.store.ping()
        except Exception as exc:
            return JSONResponse(
                errors.envelope(f"store unreachable: {type(exc).__name__}", "service_unavailable"),
                status_code=503,
            )
        return {"status": "ready", "store": "ok"}

    return app


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rollway")
    except PackageNotFoundError:
        return "0+unknown"
