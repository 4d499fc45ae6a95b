"""The model a remote agent server's rollout calls when it names one Rollway does not know.

An agent server's workflow often cannot choose its model: the Osmosis SDK's integrations send
``model: "osmosis-rollout"`` on every call, and leave the choice to the controller. So a rollout-scoped call (its
rollout known from its route or key) whose model is not an alias is served by the model its agent server was
registered with: the task's ``input.completion_params.model``, else the server's ``completion_params.model``. A
call of a runner's rollout, or of a server registered without a model, is refused as before (404
``model_not_found``). What each rollout resolves to is kept (a few thousand rollouts, the oldest dropped first),
so only a rollout's first such call reads the store.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from rollway.store import NotFoundError, Store

#: Rollouts whose choice is kept.
KEPT = 4096


class AgentModels:
    def __init__(self, store: Store) -> None:
        self._store = store
        self._chosen: OrderedDict[str, str | None] = OrderedDict()

    async def model_of(self, rollout_id: str) -> str | None:
        """The alias ``rollout_id``'s agent server calls (None: it has no agent server, or no model)."""
        if rollout_id in self._chosen:
            self._chosen.move_to_end(rollout_id)
            return self._chosen[rollout_id]
        chosen = await self._look_up(rollout_id)
        self._chosen[rollout_id] = chosen
        if len(self._chosen) > KEPT:
            self._chosen.popitem(last=False)
        return chosen

    async def _look_up(self, rollout_id: str) -> str | None:
        try:
            rollout = await self._store.get_rollout(rollout_id)
            if rollout.agent is None:
                return None
            server = await self._store.get_agent(rollout.agent)
        except NotFoundError:
            return None
        for params in (_params_of(rollout.input), server.completion_params or {}):
            model = params.get("model")
            if isinstance(model, str) and model:
                return model
        return None


def _params_of(task_input: Any) -> dict[str, Any]:
    if isinstance(task_input, dict) and isinstance(task_input.get("completion_params"), dict):
        return dict(task_input["completion_params"])
    return {}
