"""Agent-lightning 0.3's JSON shapes, built from and parsed into the store's schemas.

Rollouts are presented as Agent-lightning's ``Rollout`` (``metadata`` an object, never null) and, when they
have an attempt, as ``AttemptedRollout`` (the rollout plus ``"attempt"``: its latest one). Span attributes are
presented as OpenTelemetry attribute values (Agent-lightning validates them so): ``None`` values are left
out and structured values are JSON text. A span the gateway recorded for an LLM call with token ids is also
shown in the form of Agent-lightning's LLM proxy (``raw_gen_ai_request`` with ``llm.hosted_vllm.*``
attributes), which its ``LlmProxyTraceToTriplet`` adapter reads. A span sent with a sequence id another span
already held (Agent-lightning lets spans share one) shows that id, not the one Rollway gave it.
"""

from __future__ import annotations

from typing import Any

import orjson

from rollway.store import Attempt, AttemptedRollout, ResourcesUpdate, Rollout, Span, TaskSpec, Worker
from rollway.store.sql.spans import SENT_SEQUENCE

PROXY_SPAN_NAME = "raw_gen_ai_request"
LLM_TYPES = frozenset({"llm", "proxy_llm"})
RESOURCE_TYPES = frozenset({"llm", "proxy_llm", "prompt_template"})
TEMPLATE_ENGINES = frozenset({"jinja", "f-string", "poml"})


class ShapeError(ValueError):
    """A body that is not in Agent-lightning's shape."""


TASK_FIELDS = ("input", "mode", "resources_id", "config", "metadata")


def tasks(body: Any) -> list[TaskSpec]:
    """An enqueue body ``{"rollouts": [{input, mode?, resources_id?, config?, metadata?}, ...]}``."""
    items = body.get("rollouts") if isinstance(body, dict) else None
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise ShapeError('the body must be {"rollouts": [objects]}')
    try:
        return [TaskSpec.model_validate({k: i[k] for k in TASK_FIELDS if k in i}) for i in items]
    except ValueError as exc:
        raise ShapeError(f"invalid rollout: {exc}") from None


def attempt(value: Attempt) -> dict[str, Any]:
    return value.model_dump(mode="json")


def rollout(value: Rollout, latest: Attempt | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "rollout_id": value.rollout_id,
        "input": value.input,
        "start_time": value.start_time,
        "end_time": value.end_time,
        "mode": value.mode,
        "resources_id": value.resources_id,
        "status": value.status.value,
        "config": value.config.model_dump(mode="json"),
        "metadata": value.metadata if value.metadata is not None else {},
    }
    if latest is not None:
        out["attempt"] = attempt(latest)
    return out


def attempted(value: AttemptedRollout) -> dict[str, Any]:
    return rollout(value.rollout, value.attempt)


def worker(value: Worker) -> dict[str, Any]:
    return value.model_dump(mode="json")


def resources(value: ResourcesUpdate) -> dict[str, Any]:
    return value.model_dump(mode="json")


def named_resources(body: Any) -> dict[str, Any]:
    """Validate a named-resources body and fill in the defaults Agent-lightning's models have."""
    if not isinstance(body, dict) or not body:
        raise ShapeError("the body must be an object mapping names to resources")
    out: dict[str, Any] = {}
    for name, item in body.items():
        if not isinstance(item, dict):
            raise ShapeError(f"resource '{name}' must be an object")
        kind = item.get("resource_type")
        if kind not in RESOURCE_TYPES:
            raise ShapeError(f"resource '{name}': resource_type must be one of {sorted(RESOURCE_TYPES)}")
        resource = dict(item)
        if kind in LLM_TYPES:
            for field in ("endpoint", "model"):
                if not isinstance(resource.get(field), str):
                    raise ShapeError(f"resource '{name}': {field} must be a string")
            resource.setdefault("api_key", None)
            if resource.get("sampling_parameters") is None:
                resource["sampling_parameters"] = {}
            if not isinstance(resource["sampling_parameters"], dict):
                raise ShapeError(f"resource '{name}': sampling_parameters must be an object")
        else:
            if not isinstance(resource.get("template"), str):
                raise ShapeError(f"resource '{name}': template must be a string")
            if resource.get("engine") not in TEMPLATE_ENGINES:
                raise ShapeError(f"resource '{name}': engine must be one of {sorted(TEMPLATE_ENGINES)}")
        out[name] = resource
    return out


# -- spans ---------------------------------------------------------------------------------------------------


def attribute_value(value: Any) -> Any:
    """An OpenTelemetry attribute value: primitives and homogeneous primitive lists as they are, anything
    else as JSON text; ``None`` stays ``None`` (the caller leaves it out)."""
    if value is None or isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, list | tuple) and value:
        first = type(value[0])
        if first in (str, bool, int, float) and all(type(v) is first for v in value):
            return list(value)
    if isinstance(value, list | tuple) and not value:
        return []
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()


def attributes(values: dict[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in (values or {}).items():
        converted = attribute_value(value)
        if converted is not None:
            out[key] = converted
    return out


def _events(values: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for event in values:
        if not isinstance(event, dict) or not isinstance(event.get("name"), str):
            continue
        out.append({**event, "attributes": attributes(event.get("attributes")), "timestamp": event.get("timestamp")})
    return out


def _links(values: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Links with a span context (the only form Agent-lightning accepts); others are left out."""
    out = []
    for link in values:
        context = link.get("context") if isinstance(link, dict) else None
        if isinstance(context, dict) and "trace_id" in context and "span_id" in context:
            context = {"is_remote": False, "trace_state": {}, **context}
            out.append({**link, "context": context, "attributes": attributes(link.get("attributes"))})
    return out


def _proxy_view(name: str, attrs: dict[str, Any], status_code: str) -> tuple[str, dict[str, Any]]:
    """A gateway call with token ids, as Agent-lightning's LLM proxy would have recorded it. Only a call that
    completed: the proxy records no ``raw_gen_ai_request`` for a failed one, and ``LlmProxyTraceToTriplet``
    takes every such span for a complete call whatever its status — a cancelled or broken-off call's first
    tokens would be trained on, and could take a reward meant for a complete call (docs/exports.md leaves
    such calls out too)."""
    prompt_ids = attrs.get("rollway.prompt_token_ids")
    response_ids = attrs.get("rollway.response_token_ids")
    if status_code == "ERROR" or not isinstance(prompt_ids, list) or not isinstance(response_ids, list):
        return name, attrs
    choices = attrs.get("rollway.choices")
    if isinstance(choices, list) and choices:
        shown = [{"token_ids": c.get("token_ids")} for c in choices if isinstance(c, dict)]
    else:
        shown = [{"token_ids": response_ids}]
    attrs = dict(attrs)
    attrs["rollway.span_name"] = name
    attrs["llm.hosted_vllm.prompt_token_ids"] = str(prompt_ids)
    attrs["llm.hosted_vllm.choices"] = str(shown)
    if attrs.get("gen_ai.response.id"):
        attrs["llm.hosted_vllm.id"] = attrs["gen_ai.response.id"]
    return PROXY_SPAN_NAME, attrs


def span(value: Span) -> dict[str, Any]:
    """A stored span in Agent-lightning's ``Span`` shape."""
    raw = value.model_dump(mode="json")
    sent = raw.pop(SENT_SEQUENCE, None)
    if isinstance(sent, int) and not isinstance(sent, bool):
        raw["sequence_id"] = sent  # shared with other spans: Rollway gave it an id of its own
    name, attrs = _proxy_view(value.name, value.attributes, value.status.status_code)
    resource = raw.get("resource") or {}
    raw.update(
        name=name,
        attributes=attributes(attrs),
        events=_events(value.events),
        links=_links(value.links),
        resource={
            **resource,
            "attributes": attributes(resource.get("attributes")),
            "schema_url": resource.get("schema_url") or "",
        },
    )
    raw.setdefault("context", None)
    raw.setdefault("parent", None)
    return raw


def span_in(body: Any) -> Span:
    """An Agent-lightning span body (``rollout_id``, ``attempt_id`` and ``sequence_id`` required)."""
    if not isinstance(body, dict):
        raise ShapeError("the span must be an object")
    for field in ("rollout_id", "attempt_id", "trace_id", "span_id", "name"):
        if not isinstance(body.get(field), str) or not body[field]:
            raise ShapeError(f"span field '{field}' must be a non-empty string")
    seq = body.get("sequence_id")
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
        raise ShapeError("span field 'sequence_id' must be a positive integer")
    data = dict(body)
    if data.get("status") is None:
        data["status"] = {"status_code": "UNSET", "description": None}
    for field in ("attributes", "resource"):
        if data.get(field) is None:
            data[field] = {}
    for field in ("events", "links"):
        if data.get(field) is None:
            data[field] = []
    try:
        return Span.model_validate(data)
    except ValueError as exc:
        raise ShapeError(f"invalid span: {exc}") from None
