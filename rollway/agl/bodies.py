"""The request bodies of Agent-lightning 0.3's store protocol (its request models): unknown fields are ignored,
as its server ignores them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rollway.store import RolloutConfig, TaskSpec

Mode = Literal["train", "val", "test"]
Order = Literal["asc", "desc"]
Logic = Literal["and", "or"]


class Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class EnqueueItem(Lenient):
    input: Any = None
    mode: Mode | None = None
    resources_id: str | None = None
    config: RolloutConfig | None = None
    metadata: dict[str, Any] | None = None


class DequeueBody(Lenient):
    limit: int = 1
    worker_id: str | None = None


class StartBody(EnqueueItem):
    worker_id: str | None = None


class WorkerBody(Lenient):
    worker_id: str | None = None


class RolloutUpdate(Lenient):
    input: Any = None
    mode: Mode | None = None
    resources_id: str | None = None
    status: str | None = None
    config: RolloutConfig | None = None
    metadata: dict[str, Any] | None = None


class AttemptUpdate(Lenient):
    status: str | None = None
    worker_id: str | None = None
    last_heartbeat_time: float | None = None
    metadata: dict[str, Any] | None = None


class WorkerUpdate(Lenient):
    heartbeat_stats: dict[str, Any] | None = None


class Paging(Lenient):
    limit: int = -1
    offset: int = 0
    sort_by: str | None = None
    sort_order: Order = "asc"


class RolloutQuery(Paging):
    status_in: list[str] | None = None
    rollout_id_in: list[str] | None = None
    rollout_id_contains: str | None = None
    filter_logic: Logic = "and"


class AttemptQuery(Paging):
    sort_by: str | None = "sequence_id"


class WorkerQuery(Paging):
    status_in: list[str] | None = None
    worker_id_contains: str | None = None
    filter_logic: Logic = "and"


class SpanQuery(Paging):
    rollout_id: str
    attempt_id: str | None = None
    trace_id: str | None = None
    trace_id_contains: str | None = None
    span_id: str | None = None
    span_id_contains: str | None = None
    parent_id: str | None = None
    parent_id_contains: str | None = None
    name: str | None = None
    name_contains: str | None = None
    filter_logic: Logic = "and"
    sort_by: str | None = "sequence_id"


class NextBody(Lenient):
    rollout_id: str
    attempt_id: str


class WaitBody(Lenient):
    rollout_ids: list[str]
    #: Seconds (the route caps them); NaN or Infinity is refused: a NaN wait would never end.
    timeout: float | None = Field(default=None, allow_inf_nan=False)


def not_null(body: BaseModel, *fields: str) -> str | None:
    for name in fields:
        if name in body.model_fields_set and getattr(body, name) is None:
            return f"{name} is invalid; it cannot be a null value."
    return None


def task_of(item: EnqueueItem) -> TaskSpec:
    return TaskSpec(
        input=item.input, mode=item.mode, resources_id=item.resources_id, config=item.config, metadata=item.metadata
    )
