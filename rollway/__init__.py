"""Rollway: an OpenAI-compatible LLM gateway for agent reinforcement learning, with an embedded rollout store.

The public API, importable from here::

    from rollway import Store, AsyncRollwayClient, RollwayClient, create_app, Settings

Each name is imported on first use, so ``import rollway`` (and the ``rollway`` command) stays fast; the store pulls
in SQLAlchemy and the app FastAPI only when asked for. The rooms below it:

- ``rollway.store``: the embedded store (rollouts, attempts, spans, resources, models, keys);
- ``rollway.gateway``: the data plane (``/v1``);
- ``rollway.admin``: the control plane (``/admin/v1``) and its Python clients;
- ``rollway.agl`` and ``rollway.osmosis``: the Agent-lightning and Osmosis protocols;
- ``rollway.app``: the composition root (``create_app``); ``rollway.cli``: the command line;
- ``rollway.mock``: the vLLM-like mock backend for tests, demos and benchmarks.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollway.admin.client import AsyncRollwayClient
    from rollway.admin.client_sync import RollwayClient
    from rollway.admin.client_types import RollwayAPIError, RollwayError
    from rollway.admin.schemas import Claim
    from rollway.app.factory import create_app
    from rollway.settings import Settings
    from rollway.store import Store

# name -> the module that defines it
_PUBLIC = {
    "AsyncRollwayClient": "rollway.admin.client",
    "Claim": "rollway.admin.schemas",
    "RollwayClient": "rollway.admin.client_sync",
    "RollwayAPIError": "rollway.admin.client_types",
    "RollwayError": "rollway.admin.client_types",
    "Settings": "rollway.settings",
    "Store": "rollway.store",
    "create_app": "rollway.app.factory",
}

__all__ = [
    "AsyncRollwayClient",
    "Claim",
    "RollwayAPIError",
    "RollwayClient",
    "RollwayError",
    "Settings",
    "Store",
    "create_app",
]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'rollway' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
