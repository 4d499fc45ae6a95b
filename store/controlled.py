"""Rollouts an outside controller drives: Agent-lightning 1.0's ``agl-controller`` (local or Kubernetes) starts
each one and reports how it ended, and its trainer reads them back. What such a rollout looks like, and the
four-state view its clients see over Rollway's statuses (``store.sql.controlled`` keeps them).

The view: ``queuing`` (Rollway's ``queuing``, ``requeuing``), ``running`` (``preparing``, ``running``),
``succeeded``, ``failed`` (``failed``, and ``cancelled`` through the admin API). The controller may move a
rollout ``queuing → running | failed`` and ``running → succeeded | failed``; anything else is a conflict. The
rollouts wait in a queue of their own (``agent`` is ``CONTROLLER_AGENT``), so no Rollway runner or remote agent
server claims them.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Final, Literal

from pydantic import BaseModel, Field

from rollway.store.schemas import Backend, Rollout
from rollway.store.states import RolloutStatus

View = Literal["queuing", "running", "succeeded", "failed"]
#: The ``agent`` of every controlled rollout; agent server names may not start with ``agl:``.
CONTROLLER_AGENT: Final = "agl:controller"
RESERVED_AGENT_PREFIX: Final = "agl:"
#: The attempt id the controllers use when they name none (Agent-lightning's ``DEFAULT_ATTEMPT_ID``).
DEFAULT_ATTEMPT: Final = "0"
#: The span attribute holding the controller's attempt id of an event (an LLM call's or a posted one's).
ATTEMPT_ATTR: Final = "agl.attempt_id"
#: The span attributes of a posted event: its type, and its data as posted.
TYPE_ATTR: Final = "agl.event_type"
DATA_ATTR: Final = "agl.event_data"

R = RolloutStatus
VIEW: Final[dict[RolloutStatus, View]] = {
    R.QUEUING: "queuing",
    R.REQUEUING: "queuing",
    R.PREPARING: "running",
    R.RUNNING: "running",
    R.SUCCEEDED: "succeeded",
    R.FAILED: "failed",
    R.CANCELLED: "failed",
}
#: The view's states and the Rollway statuses each stands for.
STATUSES_OF: Final[dict[View, tuple[RolloutStatus, ...]]] = {
    view: tuple(s for s, v in VIEW.items() if v == view) for view in ("queuing", "running", "succeeded", "failed")
}
TRANSITIONS: Final[dict[View, frozenset[View]]] = {
    "queuing": frozenset({"running", "failed"}),
    "running": frozenset({"succeeded", "failed"}),
    "succeeded": frozenset(),
    "failed": frozenset(),
}
TERMINAL: Final[frozenset[View]] = frozenset({"succeeded", "failed"})


#: A model name that is also a usable alias: path-like parts of printable characters (``Qwen/Qwen3-8B``).
#: Last parts that name an action on an alias (the admin API's routes).
ALIAS_ACTIONS: Final = frozenset({"pause", "resume", "swap", "drain", "updates"})
_ALIAS_LIKE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._:@+-]*(?:/[A-Za-z0-9_][A-Za-z0-9._:@+-]*)*")


def alias_for(model: str) -> str:
    """The Rollway model alias that serves a model name registered through ``/api/models``: the name itself when
    it can be one, else ``agl-`` and a digest of it (a trainer names its model by a path such as ``/models/q``)."""
    if len(model) <= 200 and _ALIAS_LIKE.fullmatch(model) and model.rpartition("/")[2] not in ALIAS_ACTIONS:
        return model
    return "agl-" + hashlib.sha256(model.encode()).hexdigest()[:16]


def backend_id_for(endpoint: str) -> str:
    """The id of the backend an endpoint becomes: the same endpoint keeps its id, and its calls their routing."""
    return "agl-" + hashlib.sha256(endpoint.encode()).hexdigest()[:12]


class ControlledCreate(BaseModel):
    """One rollout to create: ``config`` is the controller's (timeout, local or Kubernetes runner), kept as sent."""

    rollout_id: str | None = None
    input: Any = None
    is_train: bool = True
    config: dict[str, Any] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)


class ControlledRollout(BaseModel):
    """A controlled rollout: the Rollway rollout and what its controller set."""

    rollout: Rollout
    is_train: bool
    config: dict[str, Any]
    version: int  # moves on every change the controller makes
    k8s_job_name: str | None = None
    last_attempt_id: str | None = None
    error_message: str | None = None
    created_time: float
    updated_time: float
    #: Events posted before the controller started the rollout (no attempt holds them yet), oldest first.
    early_events: list[dict[str, Any]] = Field(default_factory=list)

    @property
    def state(self) -> View:
        return VIEW[self.rollout.status]

    @property
    def events_attempt(self) -> str:
        """The attempt whose events the rollout shows."""
        return self.last_attempt_id or DEFAULT_ATTEMPT


class ControlledPatch(BaseModel):
    """A controller's change: only the fields it names (``model_fields_set``) change."""

    state: View | None = None
    k8s_job_name: str | None = None
    last_attempt_id: str | None = None
    error_message: str | None = None


class TerminalPage(BaseModel):
    """A page of the log of rollouts in the order they ended: (rollout, its view) for those not deleted."""

    items: list[ControlledRollout]
    next_after: int
    total: int


class EngineModel(BaseModel):
    """An inference endpoint the trainer registered under a model name (Agent-lightning's ``Model``)."""

    model: str = Field(min_length=1, max_length=256)
    endpoint: str = Field(min_length=1, max_length=2048)
    version: int = 0


def backends_of(name: str, registered: list[EngineModel]) -> list[Backend]:
    """The backends of the alias that serves model ``name`` (``alias_for``): one per endpoint registered for it."""
    return [
        Backend(backend_id=backend_id_for(m.endpoint), base_url=m.endpoint, model=name, version=str(m.version))
        for m in registered
        if m.model == name
    ]


class ProxyPause(BaseModel):
    """The controlled proxy's pause, one for every process on the database."""

    paused: bool = False
    retry_after_seconds: int = 5
    reason: str | None = None
    #: The model aliases the pause also holds, so calls that reach another replica before it sees the pause wait,
    #: and so those its resume resumes: the registered models' aliases it paused, those created or registered
    #: while it lasts, and those a weight update held that was to resume them. Not one an admin had paused, nor
    #: one an admin pauses or resumes meanwhile, nor an alias of no registered model (``store.sql.controlled``).
    aliases: list[str] = Field(default_factory=list)
