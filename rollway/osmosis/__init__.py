"""The Osmosis remote-rollout protocol, with Rollway as the training side (TrainGate): remote agent servers are
registered under ``/admin/v1/agents`` (``agents``), each of their rollouts is sent to them by the ``dispatcher``,
and they report how it ended on ``POST /v1/rollout/completed`` (``callbacks``). Their LLM calls come through the
data plane like any agent's (``docs/remote-agents.md``)."""
