"""The application's typed state: the long-lived objects the lifespan creates. ``RollwayApp.state`` gives it; the
FastAPI routes and probes read it through ``request.app.state.rollway``, FastAPI's place for it."""

from __future__ import annotations

from dataclasses import dataclass

from rollway.app.replicas import ReplicaReporter
from rollway.gateway.attribution import KeyCache
from rollway.gateway.metrics import Metrics
from rollway.gateway.proxy import Gateway
from rollway.gateway.registry import ModelRegistry
from rollway.gateway.routing import Router
from rollway.osmosis.dispatcher import Dispatcher
from rollway.settings import Settings
from rollway.store import Store


@dataclass
class AppState:
    settings: Settings
    store: Store
    registry: ModelRegistry
    router: Router
    gateway: Gateway
    keys: KeyCache
    metrics: Metrics
    dispatcher: Dispatcher
    reporter: ReplicaReporter
