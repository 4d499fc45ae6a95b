"""Request bodies and response shapes of the admin API (``/admin/v1``; the server's ``/openapi.json`` lists them
all). Store objects are reused as they are, except where a secret must not leave: backends are shown without
their ``api_key``. The model aliases' own bodies are ``admin.model_schemas``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from rollway.store import (
    AgentServer,
    Attempt,
    AttemptedRollout,
    AttemptStatus,
    ClaimFilter,
    ResourcesUpdate,
    Rollout,
    RolloutConfig,
    Span,
    TaskSpec,
)
from rollway.store.schemas import AgentProtocol, Mode, RewardValue


def valid_unicode(data: Any) -> Any:
    """Refuse strings that are not Unicode text (lone surrogates such as ``"\\ud8f3"``, which JSON parsers
    accept): they would be stored but could not be sent back as JSON. One orjson pass, no copy kept. The server
    validates request bodies, the clients only build them: orjson is imported here, so a client needs none."""
    import orjson

    try:
        orjson.dumps(data)
    except orjson.JSONEncodeError as exc:
        if "surrogates" in str(exc):
            raise ValueError("strings must be valid Unicode text (no lone surrogates)") from None
    return data


class UnicodeChecked(BaseModel):
    """A request body whose strings must be valid Unicode (see ``valid_unicode``)."""

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data: Any) -> Any:
        return valid_unicode(data)


class Body(UnicodeChecked):
    model_config = ConfigDict(extra="forbid")


class EnqueueRequest(Body):
    tasks: list[TaskSpec] = Field(min_length=1, max_length=100_000)


class RolloutsResponse(BaseModel):
    rollouts: list[Rollout]


class StartRequest(TaskSpec, UnicodeChecked):
    worker_id: str | None = None


class ClaimRequest(Body):
    worker_id: str | None = Field(default=None, max_length=128)
    limit: int = Field(default=1, ge=1, le=100)
    wait_seconds: float = Field(default=0.0, ge=0, le=60)
    #: Only rollouts of this mode, of this group, whose task metadata holds each key at its value.
    mode: Mode | None = None
    group_id: str | None = Field(default=None, min_length=1, max_length=200)
    metadata: dict[str, StrictStr | StrictInt | StrictFloat | StrictBool] | None = Field(default=None, max_length=16)

    def where(self) -> ClaimFilter | None:
        where = ClaimFilter(mode=self.mode, group_id=self.group_id, metadata=self.metadata)
        return None if where.empty else where


class Claim(BaseModel):
    """A rollout handed to a worker: the agent calls ``base_url`` with ``api_key`` (valid for this attempt)."""

    rollout: Rollout
    attempt: Attempt
    resources: ResourcesUpdate | None
    base_url: str
    api_key: str


class ClaimsResponse(BaseModel):
    claims: list[Claim]


class RolloutRow(Rollout):
    """A rollout as the list shows it: with its primary reward (its latest attempt's last; null: none yet)."""

    reward: float | None = None


class RolloutPage(BaseModel):
    items: list[RolloutRow]
    next_cursor: str | None


class AttemptRequest(Body):
    worker_id: str | None = Field(default=None, max_length=128)


class AttemptUpdate(Body):
    status: AttemptStatus | None = None
    metadata: dict[str, Any] | None = None
    #: A reward recorded with the update, in the same transaction (``null`` stays null, never 0).
    reward: RewardValue | None = None
    reward_name: str = Field(default="primary", min_length=1, max_length=128)


class AttemptChange(AttemptUpdate):
    """One attempt's update in a batch (``PATCH /admin/v1/attempts``): the attempt named by id (not ``latest``,
    which may be another worker's by the time a batch is sent again)."""

    rollout_id: str = Field(min_length=1, max_length=200)
    attempt_id: str = Field(min_length=1, max_length=200)
    #: Makes the reward safe to send again, as the ``Idempotency-Key`` header does for one update.
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=200)

    @field_validator("attempt_id")
    @classmethod
    def _named(cls, value: str) -> str:
        if value == "latest":
            raise ValueError("a batched update names its attempt by id, not 'latest'")
        return value


class AttemptChanges(Body):
    updates: list[AttemptChange] = Field(min_length=1, max_length=1000)


class AttemptResult(BaseModel):
    """One update's outcome: ``status`` as a lone ``PATCH`` would answer, with the attempt or the error."""

    status: int
    attempt: Attempt | None = None
    error: dict[str, Any] | None = None


class AttemptResults(BaseModel):
    results: list[AttemptResult]


class RewardRequest(Body):
    value: RewardValue | None
    name: str = Field(default="primary", min_length=1, max_length=128)
    attempt_id: str = "latest"


class SpanIn(Span):
    """A span to ingest: rollout and attempt come from the path (and ``attempt_id``, default latest)."""

    trace_id: str = ""
    span_id: str = ""


class SpansRequest(Body):
    spans: list[SpanIn] = Field(min_length=1, max_length=10_000)


class SpansResponse(BaseModel):
    spans: list[Span]


class SpanPage(BaseModel):
    items: list[Span]


class UnattributedSpanPage(BaseModel):
    items: list[Span]
    next_cursor: str | None


class WaitRequest(Body):
    rollout_ids: list[str] = Field(min_length=1, max_length=10_000)
    timeout_seconds: float = Field(default=10.0, ge=0, le=60)


class WaitResponse(BaseModel):
    finished: list[Rollout]
    pending: list[str]


class GroupHealth(BaseModel):
    """Whether a group can teach anything: GRPO compares its members' answers, so members whose agent made no LLM
    call (a client-side cache answered them: dspy's is on by default) or that all gave the same answers leave it
    without a signal. Only finished members count."""

    without_calls: list[str] = []  # finished members whose latest attempt made no LLM call
    identical_answers: bool = False  # two or more members answered, every one of them with the same token ids
    degenerate: bool = False  # either of the two


class GroupView(BaseModel):
    group_id: str
    size: int
    finished: int
    complete: bool
    rollouts: list[Rollout]
    health: GroupHealth = GroupHealth()


class ResourcesBody(Body):
    resources: dict[str, Any]


class ResourcesPage(BaseModel):
    items: list[ResourcesUpdate]
    next_cursor: str | None


class KeyRequest(Body):
    scope: Literal["gateway", "admin"] = "gateway"
    name: str | None = Field(default=None, max_length=256)
    expires_in_seconds: float | None = Field(default=None, gt=0)


class MintedKey(BaseModel):
    key_id: str
    key: str
    scope: str


class StatsView(BaseModel):
    rollouts_by_status: dict[str, int]
    attempts_by_status: dict[str, int]
    queue_depth: int
    total_rollouts: int
    total_attempts: int
    total_spans: int
    input_tokens: int
    output_tokens: int
    uptime_seconds: float


class StatusCountsView(BaseModel):
    """Rollouts and attempts by status and the queue depth: two grouped counts, cheap enough to poll."""

    rollouts_by_status: dict[str, int]
    attempts_by_status: dict[str, int]
    queue_depth: int


class SeriesPoint(BaseModel):
    """The gateway's calls that started in one bucket ``[start, start + step)``."""

    start: float
    calls: int
    calls_per_second: float
    errors: int
    latency_mean_seconds: float | None  # arrival to the end of the answer
    latency_max_seconds: float | None
    ttft_mean_seconds: float | None  # streamed calls only: arrival to the first token
    input_tokens: int
    output_tokens: int
    rewards: int = 0  # primary rewards recorded in the bucket (auxiliary reward names are not counted)
    reward_mean: float | None = None


class SeriesView(BaseModel):
    """Every bucket of the window, oldest first, empty ones included (zero calls, null means)."""

    since: float
    step_seconds: float
    points: list[SeriesPoint]


__all__ = ["AttemptedRollout", "RolloutConfig"]


class AgentPut(Body):
    """A remote agent server (Osmosis protocol). ``api_key`` is sent to it as ``Authorization: Bearer`` on
    every init; it is stored and never returned. ``completion_params`` are default sampling parameters sent
    with every init (e.g. ``{"model": "policy"}``); a task's ``input.completion_params`` override them.
    ``protocol`` (``v1`` or ``0.3``) is the Osmosis protocol the server speaks; without it Rollway tells it from
    the server's ``/health``."""

    url: str = Field(min_length=1, max_length=2048)
    api_key: SecretStr | None = None
    max_concurrent: int | None = Field(default=None, ge=1, le=100_000)
    completion_params: dict[str, Any] | None = None
    protocol: AgentProtocol | None = None


class AgentView(BaseModel):
    """An agent server as shown: never its ``api_key``, only whether one is set."""

    name: str
    url: str
    has_api_key: bool
    max_concurrent: int | None
    completion_params: dict[str, Any] | None
    protocol: AgentProtocol | None = None
    created_time: float
    updated_time: float

    @classmethod
    def of(cls, server: AgentServer) -> AgentView:
        return cls(
            name=server.name,
            url=server.url,
            has_api_key=server.api_key is not None,
            max_concurrent=server.max_concurrent,
            completion_params=server.completion_params,
            protocol=server.protocol,
            created_time=server.created_time,
            updated_time=server.updated_time,
        )


class AgentPage(BaseModel):
    items: list[AgentView]
