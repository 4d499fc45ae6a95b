"""Public objects of the store: what callers pass in and get back (pydantic, JSON-ready)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, SecretStr, field_validator

from rollway.store import ids
from rollway.store.errors import StoreValidationError
from rollway.store.states import RETRYABLE, AttemptStatus, RolloutStatus

Mode = Literal["train", "val", "test"]
BackendKind = Literal["auto", "openai", "vllm", "sglang", "litellm"]
#: The Osmosis protocol an agent server speaks: the older v1 (init and callback) or 0.3 (admit and poll).
AgentProtocol = Literal["v1", "0.3"]
KeyScope = Literal["gateway", "rollout", "admin"]
WorkerStatus = Literal["idle", "busy", "unknown"]
StatusCode = Literal["UNSET", "OK", "ERROR"]

T = TypeVar("T")

#: What a client's own rollout or group id may hold besides letters and digits (of any script). Such ids are used
#: as-is in URL paths (``/rollouts/{id}``, the claim's ``base_url``, ``/groups/{id}``): '/' would split the path
#: (even encoded), and '?', '#', '%', spaces ... would end it or be read as escapes. Non-ASCII letters are kept:
#: HTTP clients encode them in a path and the server decodes them.
CLIENT_ID_PUNCTUATION = "-_.:~@+="


def _addressable(value: str) -> str:
    if not all(c.isalnum() or c in CLIENT_ID_PUNCTUATION for c in value):
        allowed = " ".join(CLIENT_ID_PUNCTUATION)
        raise ValueError(f"a rollout or group id may only hold letters, digits and {allowed} (it is used in URL paths)")
    if value in (".", ".."):
        raise ValueError("a rollout or group id must not be '.' or '..' (URLs drop such path segments)")
    return value


ClientId = Annotated[str, Field(min_length=1, max_length=128), AfterValidator(_addressable)]


class RolloutConfig(BaseModel):
    """Timeouts and retry policy of a rollout (Agent-lightning's RolloutConfig)."""

    model_config = ConfigDict(extra="forbid")

    timeout_seconds: float | None = Field(default=None, gt=0, allow_inf_nan=False)  # (no limit: null)
    unresponsive_seconds: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    max_attempts: int = Field(default=1, ge=1, le=1_000_000)
    retry_condition: list[AttemptStatus] = Field(default_factory=list)

    @field_validator("retry_condition")
    @classmethod
    def _only_retryable(cls, value: list[AttemptStatus]) -> list[AttemptStatus]:
        bad = [s.value for s in value if s not in RETRYABLE]
        if bad:
            raise ValueError(f"retry_condition may only hold failed, timeout, unresponsive; got {bad}")
        return list(dict.fromkeys(value))


class TaskSpec(BaseModel):
    """One task to enqueue. ``group_size: n`` expands to n rollouts sharing one ``group_id``, except for a
    declared member of a named group (a direct start, or tasks of one enqueue sharing the ``group_id`` and the
    size): one rollout, in a group of size n (``store.sql.groups``)."""

    model_config = ConfigDict(extra="forbid")

    input: Any = None
    mode: Mode | None = None
    group_id: ClientId | None = None
    group_size: int | None = Field(default=None, ge=1, le=4096)
    rollout_id: ClientId | None = None
    resources_id: str | None = None
    config: RolloutConfig | None = None
    metadata: dict[str, Any] | None = None
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)  # the column is a 32-bit integer
    agent: str | None = Field(default=None, min_length=1, max_length=128)


class Attempt(BaseModel):
    rollout_id: str
    attempt_id: str
    sequence_id: int
    status: AttemptStatus
    worker_id: str | None = None
    start_time: float
    end_time: float | None = None
    last_heartbeat_time: float | None = None
    metadata: dict[str, Any] | None = None


class Rollout(BaseModel):
    rollout_id: str
    input: Any = None
    mode: Mode | None = None
    resources_id: str | None = None
    status: RolloutStatus
    config: RolloutConfig
    metadata: dict[str, Any] | None = None
    group_id: str | None = None
    group_size: int | None = None
    group_index: int | None = None
    priority: int = 0
    agent: str | None = None
    start_time: float
    end_time: float | None = None
    attempt_count: int = 0
    attempts: list[Attempt] | None = None


class ResourcesUpdate(BaseModel):
    """One version of a named-resources bundle."""

    resources_id: str
    version: int
    create_time: float
    update_time: float
    resources: dict[str, Any]


#: A value a metadata filter compares a task's metadata with (``store.sql.matching``).
MetadataValue = str | int | float | bool
#: A metadata key a filter may name: no quote or backslash, so it sits in a JSON path as it is.
_FILTER_KEY = re.compile(r"^[^\"\\]{1,128}$")
MAX_FILTER_KEYS = 16


def _finite(value: str | int | float) -> bool:
    return not isinstance(value, float) or math.isfinite(value)


def checked_metadata_filter(metadata: Mapping[str, Any] | None) -> dict[str, MetadataValue]:
    """``metadata`` as a filter (``{key: value}``), or a ``StoreValidationError`` that says what is wrong."""
    if not metadata:
        return {}
    if len(metadata) > MAX_FILTER_KEYS:
        raise StoreValidationError(f"a metadata filter names at most {MAX_FILTER_KEYS} keys")
    for key, value in metadata.items():
        if not isinstance(key, str) or not _FILTER_KEY.match(key):
            raise StoreValidationError(f"metadata filter key {key!r}: 1-128 characters, no quote or backslash")
        if value is None or not isinstance(value, str | int | float) or not _finite(value):
            raise StoreValidationError(
                f"metadata filter '{key}': the value must be a string, a finite number or a boolean"
            )
    return dict(metadata)


class ClaimFilter(BaseModel):
    """Which queued rollouts a claim may take: those of this mode, of this group, and whose task metadata holds
    each of these keys at this value (a JSON scalar; ``store.sql.matching``). Unset parts take any rollout."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Mode | None = None
    group_id: str | None = Field(default=None, min_length=1, max_length=200)
    metadata: dict[str, str | int | float | bool] | None = None

    @property
    def empty(self) -> bool:
        return self.mode is None and self.group_id is None and not self.metadata


class AttemptedRollout(BaseModel):
    """A rollout handed to a worker: the rollout, its new attempt and the resources it runs with."""

    rollout: Rollout
    attempt: Attempt
    resources: ResourcesUpdate | None = None


class SpanStatus(BaseModel):
    status_code: StatusCode = "UNSET"
    description: str | None = None


class Span(BaseModel):
    """A span in OpenTelemetry's shape plus rollout, attempt and sequence ids. Unknown fields round-trip.

    ``rollout_id``/``attempt_id`` are ``None`` for unattributed spans; ``sequence_id`` is assigned by the
    store when absent.
    """

    model_config = ConfigDict(extra="allow")

    rollout_id: str | None = None
    attempt_id: str | None = None
    sequence_id: int | None = Field(default=None, ge=1, le=2**31 - 1)  # a 32-bit column
    trace_id: str
    span_id: str
    parent_id: str | None = None
    name: str
    status: SpanStatus = Field(default_factory=SpanStatus)
    start_time: float | None = None
    end_time: float | None = None
    attributes: dict[str, Any] = Field(default_factory=dict)
    events: list[dict[str, Any]] = Field(default_factory=list)
    links: list[dict[str, Any]] = Field(default_factory=list)
    resource: dict[str, Any] = Field(default_factory=dict)


class Backend(BaseModel):
    """An inference server behind a model alias. ``api_key`` is a secret: never echoed."""

    model_config = ConfigDict(extra="forbid")

    backend_id: str = Field(default_factory=ids.backend_id, min_length=1, max_length=128)
    base_url: str = Field(min_length=1)
    kind: BackendKind = "auto"  # detected by the gateway: vllm, sglang or openai
    model: str = Field(min_length=1)
    api_key: SecretStr | None = None
    weight: float = Field(default=1.0, gt=0)
    max_concurrency: int | None = Field(default=None, ge=1, le=1_000_000)
    version: str | None = None


class ModelAlias(BaseModel):
    alias: str
    backends: list[Backend]
    version: str
    sampling: dict[str, Any] | None = None
    paused: bool = False
    created_time: float
    updated_time: float
    #: The weight update holding the alias, while one is open (``WeightUpdate``), and until when the calls it
    #: holds may wait for it (epoch seconds): past the gateway's own pause bound, since an update that moves
    #: weights can take minutes.
    update_id: str | None = None
    hold_until: float | None = None


UpdateState = Literal["open", "committed", "failed", "aborted", "expired"]
UpdateForm = Literal["reload", "trainer"]
InFlightPolicy = Literal["drain", "abort"]


class UpdatePlan(BaseModel):
    """What a weight update is asked to do (``WeightUpdate`` is what it did)."""

    to_version: str | None = None  # None: the alias's version + 1
    in_flight: InFlightPolicy = "drain"
    drain_timeout: float = 60.0  # how long the calls in flight may take to end (or be aborted)
    timeout: float = 600.0  # reload: the bound on each engine call; trainer: how long the trainer may hold
    weights_path: str | None = None  # reload from here rather than from the model's own folder
    note: str | None = None


class EngineStep(BaseModel):
    """One call a weight update made to an engine, as it went."""

    backend_id: str
    action: str  # "pause", "reload_weights", "update_weight_version", "resume", "weight_info", ...
    ok: bool
    status: int | None = None  # the engine's HTTP status (None: no answer)
    seconds: float = 0.0
    detail: str | None = None  # the engine's error, or what it reported (its weight version)


class WeightUpdate(BaseModel):
    """One change of an alias's weights: held, drained (or aborted), moved, versioned and resumed as one
    operation. ``form``: ``reload`` (Rollway asks the engines to reload in place) or ``trainer`` (the trainer moves
    the weights itself between a begin and a commit)."""

    update_id: str
    alias: str
    state: UpdateState
    form: UpdateForm
    in_flight: InFlightPolicy
    from_version: str
    to_version: str
    by: str  # who asked: the admin token, an admin key (by id) or an open loopback server
    note: str | None = None
    begun_time: float
    deadline: float  # an update still open then is expired: resumed on ``from_version``
    finished_time: float | None = None
    held_seconds: float | None = None  # from the hold to the resume: how long new calls waited at most
    drained: bool | None = None  # whether the calls in flight when it began ended (or were aborted) in time
    aborted_calls: int = 0
    steps: list[EngineStep] = Field(default_factory=list)
    engine_versions: dict[str, str | None] = Field(default_factory=dict)  # backend id → what the engine reports
    error: str | None = None


class AgentServer(BaseModel):
    """A remote agent server speaking the Osmosis remote-rollout protocol. ``api_key`` (sent to the server as
    ``Authorization: Bearer``) is a secret: never echoed. ``protocol`` is the version it speaks, or None for
    Rollway to tell it from the server's ``/health``."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128)
    url: str = Field(min_length=1, max_length=2048)
    api_key: SecretStr | None = None
    max_concurrent: int | None = Field(default=None, ge=1)
    completion_params: dict[str, Any] | None = None
    protocol: AgentProtocol | None = None
    created_time: float = 0.0
    updated_time: float = 0.0


#: A reward: a finite JSON number (an integer or a float), never a bool or a numeric string.
RewardValue = Annotated[float, Field(strict=True, allow_inf_nan=False)]


class RemoteCompletion(BaseModel):
    """What a remote agent server reports at ``POST /v1/rollout/completed`` (Osmosis ``RolloutResponse``)."""

    rollout_id: str = Field(min_length=1, max_length=128)
    status: Literal["COMPLETED", "ERROR"]
    final_messages: list[Any] = Field(default_factory=list)
    finish_reason: str | None = None
    error_message: str | None = None
    reward: RewardValue | None = None
    metrics: dict[str, Any] | None = None
    extra_fields: dict[str, Any] = Field(default_factory=dict)


class ApiKey(BaseModel):
    """A gateway or rollout-scoped key as stored (the key itself is only ever shown at mint time)."""

    key_id: str
    prefix: str
    scope: KeyScope
    name: str | None = None
    rollout_id: str | None = None
    attempt_id: str | None = None
    created_time: float
    expires_time: float | None = None
    revoked_time: float | None = None


class Worker(BaseModel):
    worker_id: str
    status: WorkerStatus = "unknown"
    heartbeat_stats: dict[str, Any] | None = None
    last_heartbeat_time: float | None = None
    last_dequeue_time: float | None = None
    last_busy_time: float | None = None
    last_idle_time: float | None = None
    current_rollout_id: str | None = None
    current_attempt_id: str | None = None


class Page(BaseModel, Generic[T]):
    items: list[T]
    next_cursor: str | None = None


class StoreStats(BaseModel):
    rollouts_by_status: dict[str, int]
    attempts_by_status: dict[str, int]
    queue_depth: int
    total_rollouts: int
    total_attempts: int
    total_spans: int
    total_resources: int
    total_workers: int
    input_tokens: int
    output_tokens: int
