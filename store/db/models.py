"""Database tables (SQLModel). Public shapes live in ``store.schemas``; these are storage only.

Times are float seconds since the epoch. JSON columns hold what clients sent, untouched. Unattributed spans
(gateway calls that belong to no rollout) use the empty string as rollout and attempt id.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, BigInteger, Column, Index, Integer, Text, UniqueConstraint, text
from sqlmodel import Field, SQLModel

#: 64-bit ids on PostgreSQL; INTEGER (the rowid alias, also 64-bit) on SQLite.
BIG_ID = BigInteger().with_variant(Integer(), "sqlite")

QUEUED_SQL = "status IN ('queuing', 'requeuing')"
#: The runners' queue (tasks for no remote agent server) and the remote agent servers' queue.
RUNNER_QUEUE_SQL = f"{QUEUED_SQL} AND agent IS NULL"
AGENT_QUEUE_SQL = f"{QUEUED_SQL} AND agent IS NOT NULL"


def _json(nullable: bool = True) -> Any:
    return Field(default=None, sa_column=Column(JSON, nullable=nullable))


class RolloutRow(SQLModel, table=True):
    __tablename__ = "rollouts"
    __table_args__ = (
        Index(
            "ix_rollouts_queue",
            text("priority DESC"),
            "queue_time",
            "pk",
            sqlite_where=text(RUNNER_QUEUE_SQL),
            postgresql_where=text(RUNNER_QUEUE_SQL),
        ),
        Index(
            "ix_rollouts_agent_queue",
            "agent",
            text("priority DESC"),
            "queue_time",
            "pk",
            sqlite_where=text(AGENT_QUEUE_SQL),
            postgresql_where=text(AGENT_QUEUE_SQL),
        ),
        Index("ix_rollouts_finish_seq", "finish_seq"),
    )

    pk: int | None = Field(default=None, primary_key=True)
    rollout_id: str = Field(max_length=128, unique=True)
    input: Any = _json()
    mode: str | None = Field(default=None, max_length=16)
    resources_id: str | None = Field(default=None, max_length=64)
    status: str = Field(max_length=16, index=True)
    config: Any = _json(nullable=False)
    meta: Any = Field(default=None, sa_column=Column("metadata", JSON, nullable=True))
    group_id: str | None = Field(default=None, max_length=128, index=True)
    group_size: int | None = None
    group_index: int | None = None
    priority: int = 0
    agent: str | None = Field(default=None, max_length=128)
    start_time: float
    end_time: float | None = None
    queue_time: float | None = None
    finish_seq: int | None = Field(default=None, sa_type=BigInteger)
    attempt_count: int = 0
    latest_attempt_id: str | None = Field(default=None, max_length=64)
    updated_time: float
    #: What the keyed request that made the row asked for, as a digest (``store.sql.replays``; migration 0005).
    request_digest: str | None = Field(default=None, max_length=32)


class AttemptRow(SQLModel, table=True):
    __tablename__ = "attempts"
    __table_args__ = (UniqueConstraint("rollout_id", "sequence_id", name="uq_attempts_rollout_sequence"),)

    pk: int | None = Field(default=None, primary_key=True)
    rollout_id: str = Field(max_length=128, foreign_key="rollouts.rollout_id")
    attempt_id: str = Field(max_length=64, unique=True)
    sequence_id: int
    status: str = Field(max_length=16)
    worker_id: str | None = Field(default=None, max_length=128)
    start_time: float
    end_time: float | None = None
    last_heartbeat_time: float | None = None
    meta: Any = Field(default=None, sa_column=Column("metadata", JSON, nullable=True))
    request_digest: str | None = Field(default=None, max_length=32)  # as the rollout's
    #: An Osmosis 0.3 agent server's polling lease (migration 0008; ``store.sql.agents.record_lease``).
    agent_lease: str | None = Field(default=None, sa_column=Column("agent_lease", Text, nullable=True))


class SpanRow(SQLModel, table=True):
    __tablename__ = "spans"
    __table_args__ = (
        UniqueConstraint("rollout_id", "attempt_id", "sequence_id", name="uq_spans_sequence"),
        UniqueConstraint("rollout_id", "attempt_id", "span_id", name="uq_spans_span_id"),
    )

    pk: int | None = Field(default=None, primary_key=True, sa_type=BIG_ID)
    rollout_id: str = Field(max_length=128)
    attempt_id: str = Field(max_length=64)
    sequence_id: int
    trace_id: str = Field(max_length=64)
    span_id: str = Field(max_length=64)
    parent_id: str | None = Field(default=None, max_length=64)
    name: str = Field(max_length=512)
    status_code: str = Field(default="UNSET", max_length=8)
    status_description: str | None = None
    start_time: float | None = None
    end_time: float | None = None
    attributes: Any = _json()
    events: Any = _json()
    links: Any = _json()
    resource: Any = _json()
    extra: Any = _json()
    input_tokens: int | None = None
    output_tokens: int | None = None
    created_time: float


class SpanSequenceRow(SQLModel, table=True):
    """The last sequence id handed out per (rollout, attempt)."""

    __tablename__ = "span_sequences"

    rollout_id: str = Field(primary_key=True, max_length=128)
    attempt_id: str = Field(primary_key=True, max_length=64)
    last_value: int = 0


class ResourcesRow(SQLModel, table=True):
    """One immutable version of a named-resources bundle; the newest row overall is "latest"."""

    __tablename__ = "resources"
    __table_args__ = (UniqueConstraint("resources_id", "version", name="uq_resources_version"),)

    pk: int | None = Field(default=None, primary_key=True)
    resources_id: str = Field(max_length=64, index=True)
    version: int
    resources: Any = _json(nullable=False)
    create_time: float
    update_time: float


class CounterRow(SQLModel, table=True):
    """Named monotonic counters (finish order of rollouts) and debounce clocks (the watchdog's)."""

    __tablename__ = "counters"

    name: str = Field(primary_key=True, max_length=64)
    value: float = 0.0


class ModelAliasRow(SQLModel, table=True):
    __tablename__ = "model_aliases"

    alias: str = Field(primary_key=True, max_length=256)
    backends: Any = _json(nullable=False)
    version: str = Field(max_length=128)
    sampling: Any = _json()
    paused: bool = False
    created_time: float
    updated_time: float
    #: The open weight update holding the alias and the end of its hold (migration 0007).
    update_id: str | None = Field(default=None, max_length=64)
    hold_until: float | None = None


class WeightUpdateRow(SQLModel, table=True):
    """One weight update of an alias (``store.sql.updates``); at most one per alias is ``open``."""

    __tablename__ = "weight_updates"
    __table_args__ = (
        Index("ix_weight_updates_alias", "alias", "begun_time"),
        Index("ix_weight_updates_state", "state"),
    )

    update_id: str = Field(primary_key=True, max_length=64)
    alias: str = Field(max_length=256)
    state: str = Field(max_length=16)
    form: str = Field(max_length=16)
    in_flight: str = Field(max_length=8)
    from_version: str = Field(max_length=128)
    to_version: str = Field(max_length=128)
    by: str = Field(max_length=256)
    note: str | None = Field(default=None, max_length=1024)
    was_paused: bool = False  # the alias's pause before the update: what its end restores
    begun_time: float
    deadline: float
    finished_time: float | None = None
    held_seconds: float | None = None
    drained: bool | None = None
    aborted_calls: int = 0
    steps: Any = _json()
    engine_versions: Any = _json()
    error: str | None = Field(default=None, sa_type=Text)


class ApiKeyRow(SQLModel, table=True):
    __tablename__ = "api_keys"

    key_id: str = Field(primary_key=True, max_length=64)
    key_hash: str = Field(max_length=128, unique=True)
    prefix: str = Field(max_length=16)
    scope: str = Field(max_length=16)
    name: str | None = Field(default=None, max_length=256)
    rollout_id: str | None = Field(default=None, max_length=128, index=True)
    attempt_id: str | None = Field(default=None, max_length=64)
    created_time: float
    expires_time: float | None = None
    revoked_time: float | None = None


class WorkerRow(SQLModel, table=True):
    __tablename__ = "workers"

    worker_id: str = Field(primary_key=True, max_length=128)
    status: str = Field(default="unknown", max_length=16)
    heartbeat_stats: Any = _json()
    last_heartbeat_time: float | None = None
    last_dequeue_time: float | None = None
    last_busy_time: float | None = None
    last_idle_time: float | None = None
    current_rollout_id: str | None = Field(default=None, max_length=128)
    current_attempt_id: str | None = Field(default=None, max_length=64)


class AgentServerRow(SQLModel, table=True):
    """A remote agent server (Osmosis protocol). ``api_key`` is what Rollway sends it: stored, never shown."""

    __tablename__ = "agent_servers"

    name: str = Field(primary_key=True, max_length=128)
    url: str = Field(max_length=2048)
    api_key: str | None = Field(default=None, max_length=1024)
    #: The key encrypted (``catalog.Cipher``) instead, when the store has a secret key (migration 0006).
    api_key_sealed: str | None = Field(default=None, sa_type=Text)
    max_concurrent: int | None = None
    completion_params: Any = _json()
    #: ``v1`` or ``0.3``, the protocol given at registration, or None when none was: the dispatcher then tells it
    #: from the server's ``/health`` and keeps that in memory, never here (migration 0010).
    protocol: str | None = Field(default=None, max_length=8)
    created_time: float
    updated_time: float


class GatewayReplicaRow(SQLModel, table=True):
    """A gateway process serving on this database and its last report of the calls it has in flight, so a drain
    through one replica waits for the calls of every other (``store.replicas``)."""

    __tablename__ = "gateway_replicas"

    replica_id: str = Field(primary_key=True, max_length=64)
    host: str = Field(max_length=255)
    pid: int
    started_time: float
    reported_time: float
    revision: int = Field(default=0, sa_type=BigInteger)  # the catalog revision the report was written under
    in_flight: Any = _json(nullable=False)  # {alias: {configuration key: calls}}


class ControlledRolloutRow(SQLModel, table=True):
    """What an outside controller set on a rollout it drives (``store.sql.controlled``, migration 0009)."""

    __tablename__ = "controlled_rollouts"

    rollout_id: str = Field(primary_key=True, max_length=128, foreign_key="rollouts.rollout_id")
    is_train: bool = True
    config: Any = _json(nullable=False)
    version: int = 1
    k8s_job_name: str | None = Field(default=None, sa_type=Text)
    last_attempt_id: str | None = Field(default=None, max_length=128)
    error_message: str | None = Field(default=None, sa_type=Text)
    early_events: Any = _json()
    created_time: float
    updated_time: float
    #: Its place in the log of the order controlled rollouts ended (1, 2, ...), given by its first terminal transition.
    terminal_seq: int | None = Field(default=None, index=True)
    #: Deleted through the controller's API: hidden from it, kept for the admin API and exports.
    deleted_time: float | None = None


class EngineModelRow(SQLModel, table=True):
    """An endpoint a trainer registered under a model name for the controlled proxy (migration 0009)."""

    __tablename__ = "engine_models"

    model: str = Field(primary_key=True, max_length=256)
    endpoint: str = Field(primary_key=True, max_length=2048)
    version: int = 0
    created_time: float


class ProxyPauseRow(SQLModel, table=True):
    """The controlled proxy's pause: one row, ``name = 'proxy'`` (migration 0009)."""

    __tablename__ = "proxy_pause"

    name: str = Field(primary_key=True, max_length=32)
    paused: bool = False
    retry_after_seconds: int = 5
    reason: str | None = Field(default=None, sa_type=Text)
    aliases: Any = _json()
    updated_time: float


rollouts = RolloutRow.__table__  # type: ignore[attr-defined]
attempts = AttemptRow.__table__  # type: ignore[attr-defined]
spans = SpanRow.__table__  # type: ignore[attr-defined]
span_sequences = SpanSequenceRow.__table__  # type: ignore[attr-defined]
resources = ResourcesRow.__table__  # type: ignore[attr-defined]
counters = CounterRow.__table__  # type: ignore[attr-defined]
model_aliases = ModelAliasRow.__table__  # type: ignore[attr-defined]
api_keys = ApiKeyRow.__table__  # type: ignore[attr-defined]
workers = WorkerRow.__table__  # type: ignore[attr-defined]
agent_servers = AgentServerRow.__table__  # type: ignore[attr-defined]
gateway_replicas = GatewayReplicaRow.__table__  # type: ignore[attr-defined]
weight_updates = WeightUpdateRow.__table__  # type: ignore[attr-defined]
controlled_rollouts = ControlledRolloutRow.__table__  # type: ignore[attr-defined]
engine_models = EngineModelRow.__table__  # type: ignore[attr-defined]
proxy_pause = ProxyPauseRow.__table__  # type: ignore[attr-defined]
