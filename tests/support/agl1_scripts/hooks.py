"""Rollout hooks for ``trainer.py --hooks hooks.py`` (loaded by path with ``agentlightning.hooks.load_hooks``, which
wants exactly one ``RolloutHooks`` subclass here). They make the manager exercise the server the way a user's hooks
do: ``on_enqueue`` adds a metadata extra (kept by ``POST /api/rollouts``); ``on_succeeded`` reads the raw events
(the manager GETs them for it) and has the manager POST a ``hook`` event on the rollout's last attempt, before it
builds the triplets; ``on_failed`` posts one too."""

from __future__ import annotations

from typing import Any

from agentlightning.hooks import RolloutHooks, TraceWriter
from agentlightning.schemas import Rollout, RolloutCreate


class MarkingHooks(RolloutHooks):  # type: ignore[misc]  # agentlightning: Any where not installed
    def on_enqueue(self, request: RolloutCreate) -> RolloutCreate:
        return request.model_copy(update={"metadata": {"hooked": True}})

    def on_succeeded(self, rollout: Rollout, events: dict[str, list[Any]], store: TraceWriter) -> None:
        attempt = rollout.status.last_attempt_id or "0"
        counts = {attempt_id: len(items) for attempt_id, items in events.items()}
        store.add_event(rollout.rollout_id, attempt, "hook", {"on": "succeeded", "events_by_attempt": counts})

    def on_failed(self, rollout: Rollout, store: TraceWriter) -> None:
        attempt = rollout.status.last_attempt_id or "0"
        store.add_event(rollout.rollout_id, attempt, "hook", {"on": "failed", "error": rollout.status.error_message})
