"""Small builders shared by the store contract tests."""

from __future__ import annotations

import itertools
from typing import Any

from store import Store, TaskSpec

_span_ids = itertools.count(1)


def span(rollout_id: str | None, attempt_id: str | None = None, **fields: Any) -> dict[str, Any]:
    """A minimal span for ``rollout_id``/``attempt_id`` with a fresh span id."""
    n = next(_span_ids)
    return {
        "rollout_id": rollout_id,
        "attempt_id": attempt_id,
        "trace_id": f"trace-{n:08d}",
        "span_id": f"span-{n:08d}",
        "name": "llm.call",
        **fields,
    }


async def enqueue_one(store: Store, **task: Any) -> str:
    [rollout] = await store.enqueue([TaskSpec(**task)])
    return rollout.rollout_id
