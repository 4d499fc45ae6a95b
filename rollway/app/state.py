"""The application's typed state (``app.state.rollway``): the long-lived objects the lifespan creates, which the
routes and probes read through ``request.app.state.rollway``."""

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
