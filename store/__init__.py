"""Rollway's embedded store: rollouts, attempts, spans, resources, models and keys over SQLite or PostgreSQL.

It knows nothing of HTTP. ``Store.open(url)`` creates or upgrades the schema and starts the single batched
writer (SQLite), the watchdog and the heartbeat of calls in flight; every other public object is a pydantic
schema from ``store.schemas``.
"""

from rollway.store.errors import ConflictError, NotFoundError, StoreError, StoreValidationError, UnavailableError
from rollway.store.schemas import (
    AgentServer,
    ApiKey,
    Attempt,
    AttemptedRollout,
    Backend,
    ModelAlias,
    Page,
    RemoteCompletion,
    ResourcesUpdate,
    Rollout,
    RolloutConfig,
    Span,
    SpanStatus,
    StoreStats,
    TaskSpec,
    Worker,
)
from rollway.store.states import AttemptStatus, RolloutStatus
from rollway.store.store import UNSET, Store

__all__ = [
    "UNSET",
    "AgentServer",
    "ApiKey",
    "Attempt",
    "AttemptStatus",
    "AttemptedRollout",
    "Backend",
    "ConflictError",
    "ModelAlias",
    "NotFoundError",
    "Page",
    "RemoteCompletion",
    "ResourcesUpdate",
    "Rollout",
    "RolloutConfig",
    "RolloutStatus",
    "Span",
    "SpanStatus",
    "Store",
    "StoreError",
    "StoreStats",
    "StoreValidationError",
    "TaskSpec",
    "UnavailableError",
    "Worker",
]
