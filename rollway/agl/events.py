"""A controlled rollout's spans as Agent-lightning 1.0's events, raw and in its triplet view.

- An LLM call's span (made by ``/proxy/...``) is a ``model_request`` event: the body forwarded (its ``model`` the
  registered name), the engine's answer (for a stream, the answer accumulated, shaped like a whole one), the
  server (model, endpoint, version), latency, status, retries, usage and finish reason.
- A posted event's span gives back its type and data as they were posted.
- Spans of other attempt ids than the one the rollout shows are left out, and so are spans no controller's call
  made (an admin's reward, say): the events are what the controller's clients wrote.

The triplet view keeps of a ``model_request`` only its prompt and response token ids, the logprobs (None when
missing or any is not finite), the server, the status and the error, and of a ``reward`` its value, source and
reason; then it keeps the last ``model_request`` of each prompt (the agent's own retries), leaving alone those
without a prompt key of plain integers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from rollway.store.controlled import (
    ATTEMPT_ATTR,
    DATA_ATTR,
    TYPE_ATTR,
    ControlledRollout,
    EngineModel,
    alias_for,
    backend_id_for,
)
from rollway.store.schemas import Span


def raw_events(
    controlled: ControlledRollout, spans: Iterable[Span], models: list[EngineModel], event_type: str | None = None
) -> list[dict[str, Any]]:
    rollout_id, attempt = controlled.rollout.rollout_id, controlled.events_attempt
    found: list[tuple[float, int, dict[str, Any]]] = []
    for position, early in enumerate(controlled.early_events):
        if early["attempt_id"] == attempt:
            found.append((early["timestamp"], -len(controlled.early_events) + position, early))
    for span in spans:
        attributes = span.attributes or {}
        if attributes.get(ATTEMPT_ATTR) != attempt:
            continue
        when = span.end_time or span.start_time or 0.0
        if TYPE_ATTR in attributes:
            event = {"event_type": attributes[TYPE_ATTR], "data": attributes.get(DATA_ATTR) or {}}
        elif "gen_ai.operation.name" in attributes:
            event = {"event_type": "model_request", "data": model_request(attributes, models)}
        else:
            continue
        found.append((when, span.sequence_id or 0, event | {"attempt_id": attempt, "timestamp": when}))
    found.sort(key=lambda item: (item[0], item[1]))
    events = [{"rollout_id": rollout_id, **event} for _, _, event in found]
    if event_type is not None:
        events = [e for e in events if e["event_type"] == event_type]
    return events


def model_request(attributes: dict[str, Any], models: list[EngineModel]) -> dict[str, Any]:
    """The ``model_request`` data of an LLM call's span."""
    alias = attributes.get("gen_ai.request.model")
    name = next((m.model for m in models if alias_for(m.model) == alias), alias)
    backend = attributes.get("rollway.backend_id")
    endpoint = next((m for m in models if m.model == name and backend_id_for(m.endpoint) == backend), None)
    version = _version(attributes.get("rollway.model_version"))
    request = attributes.get("rollway.request")
    request = dict(request) | {"model": name} if isinstance(request, dict) else {}
    response = attributes.get("rollway.response")
    if not isinstance(response, dict):
        error = attributes.get("rollway.error")
        response = {"error": {"message": error}} if error else {}
    status_code = attributes.get("http.response.status_code")
    ok = (
        attributes.get("rollway.error") is None and (status_code or 0) < 400 and not attributes.get("rollway.cancelled")
    )
    latency = attributes.get("rollway.latency_seconds")
    choices = response.get("choices") or []
    return {
        "model": name,
        "model_version": version,
        "request": request,
        "response": response,
        "server": {
            "model": name,
            "endpoint": endpoint.endpoint if endpoint else None,
            "version": endpoint.version if endpoint else version,
        },
        "latency_ms": None if latency is None else latency * 1000.0,
        "http_status": status_code,
        "status": "ok" if ok else "error",
        "retry_count": attributes.get("rollway.retry_count") or 0,
        "routed_experts": None,
        "usage": response.get("usage"),
        "finish_reason": choices[0].get("finish_reason") if choices and isinstance(choices[0], dict) else None,
    }


def _version(value: Any) -> Any:
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    return value


def triplet_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    trimmed = [_trimmed(event) for event in events]
    last_of: dict[tuple[int, ...], int] = {}
    kept: set[int] = set()
    for index, event in enumerate(trimmed):
        if event["event_type"] != "model_request":
            continue
        prompt = event["data"].get("prompt_token_ids")
        if not isinstance(prompt, list) or not prompt or any(type(t) is not int for t in prompt):
            kept.add(index)
            continue
        last_of[tuple(prompt)] = index
    kept.update(last_of.values())
    return [e for i, e in enumerate(trimmed) if e["event_type"] != "model_request" or i in kept]


def without_routed_experts(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for event in events:
        if event["event_type"] == "model_request" and "routed_experts" in event["data"]:
            event = event | {"data": {k: v for k, v in event["data"].items() if k != "routed_experts"}}
        out.append(event)
    return out


def _trimmed(event: dict[str, Any]) -> dict[str, Any]:
    data = event["data"]
    if event["event_type"] == "reward":
        return event | {"data": {"value": data.get("value")} | {k: data[k] for k in ("source", "reason") if k in data}}
    if event["event_type"] != "model_request":
        return event
    response = data.get("response")
    prompt: Any = []
    output: Any = []
    logprobs = None
    if isinstance(response, dict):
        prompt = response.get("prompt_token_ids") or []
        choices = response.get("choices") or []
        if choices and isinstance(choices[0], dict):
            prompt = prompt or choices[0].get("prompt_token_ids") or []
            output = choices[0].get("token_ids") or []
            logprobs = _logprobs(choices[0])
    server = data.get("server") or {}
    out: dict[str, Any] = {
        "prompt_token_ids": prompt,
        "response_token_ids": output,
        "response_log_probs": logprobs,
        "server": {"model": server.get("model"), "version": server.get("version")},
    }
    if data.get("routed_experts") is not None:
        out["routed_experts"] = data["routed_experts"]
    for key in ("http_status", "status"):
        if key in data:
            out[key] = data[key]
    if isinstance(response, dict) and "error" in response:
        out["error"] = response["error"]
    return event | {"data": out}


def _logprobs(choice: dict[str, Any]) -> list[float] | None:
    """The chosen tokens' logprobs of a chat or a text completion choice; None when missing or not all finite."""
    given = choice.get("logprobs")
    if not isinstance(given, dict):
        return None
    if isinstance(given.get("content"), list):
        raw = []
        for item in given["content"]:
            if not isinstance(item, dict) or "logprob" not in item:
                return None
            raw.append(item["logprob"])
    elif isinstance(given.get("token_logprobs"), list):
        raw = list(given["token_logprobs"])
    else:
        return None
    out = []
    for value in raw:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return None
        out.append(float(value))
    return out
