"""Rollway's embedded store: rollouts, attempts, spans, resources, models and keys over SQLite or PostgreSQL.

It knows nothing of HTTP. ``Store.open(url)`` creates or upgrades the schema and starts the single batched
writer (SQLite), the watchdog and the heartbeat of calls in flight; every other public object is a pydantic
schema from ``store.schemas``.

Each name is imported on first use (PEP 562), so that ``rollway.store.schemas`` (the pydantic schemas a client
or the ``rollway`` command needs) comes without SQLAlchemy: only ``Store`` (and ``UNSET``) pull in the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollway.store.errors import ConflictError, NotFoundError, StoreError, StoreValidationError, UnavailableError
    from rollway.store.exports import ExportPage, ExportQuery
    from rollway.store.parts.lifecycle import UNSET
    from rollway.store.schemas import (
        AgentServer,
        ApiKey,
        Attempt,
        AttemptedRollout,
        Backend,
        ClaimFilter,
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
        WeightUpdate,
        Worker,
    )
    from rollway.store.states import AttemptStatus, RolloutStatus
    from rollway.store.store import Store

# name -> the module that defines it
_PUBLIC = {
    **dict.fromkeys(
        ("ConflictError", "NotFoundError", "StoreError", "StoreValidationError", "UnavailableError"),
        "rollway.store.errors",
    ),
    **dict.fromkeys(
        (
            "AgentServer",
            "ApiKey",
            "Attempt",
            "AttemptedRollout",
            "Backend",
            "ClaimFilter",
            "ModelAlias",
            "Page",
            "RemoteCompletion",
            "ResourcesUpdate",
            "Rollout",
            "RolloutConfig",
            "Span",
            "SpanStatus",
            "StoreStats",
            "TaskSpec",
            "WeightUpdate",
            "Worker",
        ),
        "rollway.store.schemas",
    ),
    **dict.fromkeys(("AttemptStatus", "RolloutStatus"), "rollway.store.states"),
    **dict.fromkeys(("ExportPage", "ExportQuery"), "rollway.store.exports"),
    "UNSET": "rollway.store.parts.lifecycle",
    "Store": "rollway.store.store",
}

__all__ = [
    "UNSET",
    "AgentServer",
    "ApiKey",
    "Attempt",
    "AttemptStatus",
    "AttemptedRollout",
    "Backend",
    "ClaimFilter",
    "ConflictError",
    "ExportPage",
    "ExportQuery",
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
    "WeightUpdate",
    "Worker",
]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:  # a submodule (``from rollway.store import ids``) is then imported by the import system
        raise AttributeError(f"module 'rollway.store' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
