"""What an Osmosis 0.3 agent server (``osmosis-ai`` 0.3's ``RolloutServer``) and its controller send each other,
apart from the controller's own steps (``rollway.osmosis.v03``): the protocol a server speaks, told from its
``/health``; the request headers; an admission's answer and its polling lease; a task's label; a result as the
completion Rollway records; and a refusal as text fit to store and log (keys masked, a redirect named)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from rollway.osmosis import restarts
from rollway.osmosis.restarts import health_of
from rollway.store import AgentServer, RemoteCompletion
from rollway.store.db.limits import nonfinite_name
from rollway.store.schemas import AgentProtocol

LEASE_HEADER = "X-Osmosis-Rollout-Lease"


Protocol = AgentProtocol


@dataclass(frozen=True, slots=True)
class Admitted:
    osmosis_id: str
    lease: str
    wait_seconds: float
    lease_seconds: float


def admitted_of(raw: bytes, attempt_id: str) -> Admitted | None:
    """The admission a 202 answer grants, or None when its body is not a 0.3 admission (not a JSON object, no
    ``polling_lease_token``, a wait or lease that is not a positive number): a run with no lease to poll it by."""
    try:
        answer = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(answer, dict) or not isinstance(lease := answer.get("polling_lease_token"), str) or not lease:
        return None
    try:
        wait_seconds = float(answer.get("result_wait_timeout_sec") or 30.0)
        lease_seconds = float(answer.get("polling_lease_timeout_sec") or 120.0)
    except (TypeError, ValueError):
        return None
    if not all(math.isfinite(x) and x > 0 for x in (wait_seconds, lease_seconds)):
        return None
    return Admitted(str(answer.get("rollout_id") or attempt_id), lease, wait_seconds, lease_seconds)


def json_of(raw: bytes) -> Any:
    """An answer's JSON body, None when it is empty or not JSON. Python's own parser reads what orjson refuses:
    ``NaN``, ``Infinity`` and ``-Infinity``, which a server written in Python sends for a metric that is not
    finite (the store keeps them by name, ``store.db.limits.named_nonfinite``)."""
    if not raw:
        return None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(raw)
    except ValueError:  # (UnicodeDecodeError included)
        return None


def headers_of(server: AgentServer) -> dict[str, str]:
    out = {"Content-Type": "application/json"}
    if server.api_key is not None:
        out["Authorization"] = f"Bearer {server.api_key.get_secret_value()}"
    return out


def masked(raw: bytes, server: AgentServer, key: str) -> str:
    """An agent server's answer as text for the attempt's error, which is stored and logged: at most 300
    characters, with the attempt's ``rk-`` key and the server's own api key masked (a server may echo either)."""
    said = raw.decode(errors="replace")
    if key:
        said = said.replace(key, "rk-***")
    if server.api_key is not None and (secret := server.api_key.get_secret_value()):
        said = said.replace(secret, "***")
    return said[:300]


def redirected(response: aiohttp.ClientResponse) -> str:
    """Where a redirect pointed, for the attempt's error; nothing for any other answer. Redirects to agent servers
    are never followed: the admission's body carries the attempt's key, which would go wherever it points."""
    if 300 <= response.status < 400:
        return f" (a redirect to {response.headers.get('Location', '?')[:200]}, not followed)"
    return ""


@dataclass(frozen=True, slots=True)
class Probed:
    """What a server's ``/health`` told of its protocol: ``spoken``, or None when it told nothing; then ``said``
    is the answer as text for the attempt's error, and ``passing`` whether asking again may tell (no answer, a
    429 or a 5xx: a server starting, busy or failing for now)."""

    spoken: Protocol | None
    said: str = ""
    passing: bool = False


async def probe(session: aiohttp.ClientSession, server: AgentServer) -> Probed:
    """Which protocol ``server`` speaks. A 0.3 RolloutServer always serves ``GET /health``: 200 with
    ``process_id`` and ``lifecycle``, or 401 when the request lacks its key (the probe sends the registered one).
    So ``0.3`` on such a 200; ``v1`` on any other 2xx, or a 4xx that is not 401, 403, 408 or 429 (a 404; a 405
    from a server with POST routes only; a 400, 410 or 422 from one that refuses the GET): no 0.3 server says
    that. None otherwise, for the caller to ask again or give up: no answer, a 408, 429 or 5xx (a server
    starting, busy or failing for now, ``passing``); a 401 or 403, which a 0.3 server answers to a wrong key as a
    v1 server behind auth does, so it tells nothing until the key is right (a guess would be kept for the
    registration); a redirect (never followed) or any other status."""
    url = f"{server.url}/health"
    status, health = await health_of(session, url, headers_of(server))
    if 200 <= status < 300:
        clear = status == 200 and isinstance(health, dict) and "process_id" in health and "lifecycle" in health
        return Probed("0.3" if clear else "v1")
    if 400 <= status < 500 and status not in (401, 403, 408, 429):
        return Probed("v1")
    if status == 0:
        return Probed(None, f"GET {url} had no answer within {restarts.HEALTH_TIMEOUT:g} s", passing=True)
    body = masked(orjson.dumps(health), server, "") if health is not None else "a body that is not JSON"
    said = f"GET {url} answered {status}: {body}"
    if status in (401, 403):
        said += " (the registered api key was refused)" if server.api_key is not None else " (no api key is registered)"
    return Probed(None, said, passing=status in (408, 429) or status >= 500)


def label_of(task_input: Any, metadata: dict[str, Any]) -> str | None:
    for source in (task_input, metadata):
        if isinstance(source, dict) and source.get("label") is not None:
            value = source["label"]
            return value if isinstance(value, str) else orjson.dumps(value).decode()
    return None


def result_report(rollout_id: str, result: dict[str, Any]) -> RemoteCompletion | None:
    """A 0.3 result as the completion Rollway records (None while the rollout has not ended). A success whose
    reward is NaN or infinite is recorded as a failure (``invalid_reward``) that names it."""
    status = result.get("status")
    sample = result.get("sample") if isinstance(result.get("sample"), dict) else {}
    assert isinstance(sample, dict)
    metrics = sample.get("metrics") if isinstance(sample.get("metrics"), dict) else None
    messages = sample.get("messages") if isinstance(sample.get("messages"), list) else []
    extra = dict(sample.get("extra_fields") or {}) if isinstance(sample.get("extra_fields"), dict) else {}
    if status == "success":
        removed = bool(sample.get("remove_sample"))
        if removed:
            extra["remove_sample"] = True
        reward = sample.get("reward")
        if not removed and isinstance(reward, float) and not math.isfinite(reward):
            # a grader's NaN is no reward to train on, nor a success without one (v1's report would be refused)
            return RemoteCompletion(
                rollout_id=rollout_id,
                status="ERROR",
                final_messages=messages,
                finish_reason="invalid_reward",
                error_message=f"the agent server reported a reward of {nonfinite_name(reward)}: not a finite number",
                metrics=metrics,
                extra_fields=extra,
            )
        if removed or isinstance(reward, bool) or not isinstance(reward, int | float):
            reward = None  # the server sends null unless a success keeps its sample
        return RemoteCompletion(
            rollout_id=rollout_id,
            status="COMPLETED",
            final_messages=messages,
            finish_reason="remove_sample" if removed else "success",
            reward=None if reward is None else float(reward),
            metrics=metrics,
            extra_fields=extra,
        )
    if status in ("failure", "cancelled"):
        category = result.get("err_category") or status
        message = result.get("err_message") or ("cancelled by the agent server" if status == "cancelled" else "")
        return RemoteCompletion(
            rollout_id=rollout_id,
            status="ERROR",
            final_messages=messages,
            finish_reason=str(category),
            error_message=f"{category}: {message}" if message else str(category),
            metrics=metrics,
            extra_fields=extra,
        )
    return None
