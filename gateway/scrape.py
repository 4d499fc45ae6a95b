"""The gauges ``/metrics`` computes at scrape time (``Metrics.refresh`` reads the store for them): rollouts and
attempts by status, the queue depth, each alias's pause and update, and each backend's health and load as this
process's router sees it. A store that is slow or down leaves the last snapshot in place, and
``rollway_store_up`` says 0."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily, Metric

from rollway.gateway.routing import Router
from rollway.store import ModelAlias


@dataclass
class Snapshot:
    """What the last scrape read from the store."""

    rollouts: dict[str, int]
    attempts: dict[str, int]
    models: list[ModelAlias]
    taken_at: float


class StateCollector:
    """Gauges computed at scrape time: from the store snapshot and the router's passive health."""

    def __init__(self) -> None:
        self.snapshot: Snapshot | None = None
        self.store_up: bool | None = None
        self.router: Router | None = None
        #: (alias, backend, whether its engine reports another weight version): ``gateway.versions``.
        self.engine_versions: Callable[[], Iterable[tuple[str, str, bool]]] | None = None

    def describe(self) -> Iterable[Metric]:
        return list(self._families())

    def collect(self) -> Iterable[Metric]:
        return list(self._families())

    def _families(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("rollway_store_up", "1 when the last scrape could read the store in time.")
        up.add_metric([], 1.0 if self.store_up or self.store_up is None else 0.0)
        yield up
        snap = self.snapshot
        rollouts = GaugeMetricFamily("rollway_rollouts", "Rollouts by status.", labels=["status"])
        attempts = GaugeMetricFamily("rollway_attempts", "Attempts by status.", labels=["status"])
        queue = GaugeMetricFamily("rollway_queue_depth", "Rollouts waiting for a worker (queuing, requeuing).")
        paused = GaugeMetricFamily("rollway_model_paused", "1 when the model alias is paused.", labels=["alias"])
        updating = GaugeMetricFamily(
            "rollway_model_updating", "1 while a weight update holds the model alias.", labels=["alias"]
        )
        backend_up = GaugeMetricFamily(
            "rollway_backend_up",
            "1 when this process routes to the backend (not ejected by passive health checks).",
            labels=["alias", "backend"],
        )
        outstanding = GaugeMetricFamily(
            "rollway_backend_outstanding_requests",
            "Tries in flight to the backend from this process.",
            labels=["alias", "backend"],
        )
        waiting = GaugeMetricFamily(
            "rollway_requests_waiting",
            "Calls waiting in this process for a backend slot: every backend of the alias at its max_concurrency.",
            labels=["alias"],
        )
        if snap is not None:
            for status, n in snap.rollouts.items():
                rollouts.add_metric([status], n)
            for status, n in snap.attempts.items():
                attempts.add_metric([status], n)
            queue.add_metric([], snap.rollouts.get("queuing", 0) + snap.rollouts.get("requeuing", 0))
            router = self.router
            for model in snap.models:
                paused.add_metric([model.alias], 1.0 if model.paused else 0.0)
                updating.add_metric([model.alias], 0.0 if model.update_id is None else 1.0)
                waiting.add_metric([model.alias], 0 if router is None else router.waiting(model.alias))
                for backend in model.backends:
                    labels = [model.alias, backend.backend_id]
                    healthy = router is None or router.is_up(backend.backend_id)
                    backend_up.add_metric(labels, 1.0 if healthy else 0.0)
                    busy = 0 if router is None else router.health(backend.backend_id).outstanding
                    outstanding.add_metric(labels, busy)
        differs = GaugeMetricFamily(
            "rollway_engine_version_mismatch",
            "1 while the backend's engine reports another weight version than its calls are recorded under.",
            labels=["alias", "backend"],
        )
        for alias, backend_id, mismatch in self.engine_versions() if self.engine_versions is not None else ():
            differs.add_metric([alias, backend_id], 1.0 if mismatch else 0.0)
        yield from (rollouts, attempts, queue, paused, updating, backend_up, outstanding, waiting, differs)
