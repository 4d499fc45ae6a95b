"""Database rows to public objects."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import RowMapping

from rollway.store.db.limits import int32_or_none
from rollway.store.schemas import Attempt, ResourcesUpdate, Rollout, RolloutConfig, Span, SpanStatus


def rollout(row: RowMapping) -> Rollout:
    return Rollout(
        rollout_id=row["rollout_id"],
        input=row["input"],
        mode=row["mode"],
        resources_id=row["resources_id"],
        status=row["status"],
        config=RolloutConfig.model_validate(row["config"]),
        metadata=row["metadata"],
        group_id=row["group_id"],
        group_size=row["group_size"],
        group_index=row["group_index"],
        priority=row["priority"],
        agent=row["agent"],
        start_time=row["start_time"],
        end_time=row["end_time"],
        attempt_count=row["attempt_count"],
    )


def attempt(row: RowMapping) -> Attempt:
    return Attempt(
        rollout_id=row["rollout_id"],
        attempt_id=row["attempt_id"],
        sequence_id=row["sequence_id"],
        status=row["status"],
        worker_id=row["worker_id"],
        start_time=row["start_time"],
        end_time=row["end_time"],
        last_heartbeat_time=row["last_heartbeat_time"],
        metadata=row["metadata"],
    )


def resources(row: RowMapping) -> ResourcesUpdate:
    return ResourcesUpdate(
        resources_id=row["resources_id"],
        version=row["version"],
        create_time=row["create_time"],
        update_time=row["update_time"],
        resources=row["resources"],
    )


SPAN_FIELDS = frozenset(Span.model_fields)


# The spans table's columns (all but ``pk``) in insert order; ``span_values`` returns a tuple in this order.
SPAN_COLUMNS = (
    "rollout_id",
    "attempt_id",
    "sequence_id",
    "trace_id",
    "span_id",
    "parent_id",
    "name",
    "status_code",
    "status_description",
    "start_time",
    "end_time",
    "attributes",
    "events",
    "links",
    "resource",
    "extra",
    "input_tokens",
    "output_tokens",
    "created_time",
)


def span_values(
    span: Span,
    rollout_id: str,
    attempt_id: str,
    sequence_id: int,
    now: float,
    encode: Callable[[Any], Any],
) -> tuple[Any, ...]:
    """The row for a span as a tuple in ``SPAN_COLUMNS`` order, JSON columns passed through ``encode``; fields
    the schema does not know are kept in ``extra``. A tuple, not a dict: this runs once per span written."""
    attributes = span.attributes
    status = span.status
    return (
        rollout_id,
        attempt_id,
        sequence_id,
        span.trace_id,
        span.span_id,
        span.parent_id,
        span.name,
        status.status_code,
        status.description,
        span.start_time,
        span.end_time,
        encode(attributes),
        encode(span.events),
        encode(span.links),
        encode(span.resource),
        encode(span.model_extra or None),
        int32_or_none(attributes.get("gen_ai.usage.input_tokens")),
        int32_or_none(attributes.get("gen_ai.usage.output_tokens")),
        now,
    )


def span(row: RowMapping) -> Span:
    extra: dict[str, Any] = row["extra"] or {}
    return Span(
        rollout_id=row["rollout_id"] or None,
        attempt_id=row["attempt_id"] or None,
        sequence_id=row["sequence_id"],
        trace_id=row["trace_id"],
        span_id=row["span_id"],
        parent_id=row["parent_id"],
        name=row["name"],
        status=SpanStatus(status_code=row["status_code"], description=row["status_description"]),
        start_time=row["start_time"],
        end_time=row["end_time"],
        attributes=row["attributes"] or {},
        events=row["events"] or [],
        links=row["links"] or [],
        resource=row["resource"] or {},
        **{k: v for k, v in extra.items() if k not in SPAN_FIELDS},
    )
