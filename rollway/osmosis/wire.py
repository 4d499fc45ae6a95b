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
    """Which protocol ``server`` speaks: ``0.3`` when its ``/health`` is a 0.3 RolloutServer's, ``v1`` on a clear
    answer that it is not (a 404, or a 200 without ``process_id`` and ``lifecycle``), None otherwise (no answer, a
    5xx, 401, 403, 429 or any other status: a 0.3 server that is failing, busy or refusing the key says nothing
    of its protocol), for the caller to ask again or give up."""
    url = f"{server.url}/health"
    status, health = await health_of(session, url, headers_of(server))
    if status == 404:
        return Probed("v1")
    if status == 200:
        clear = isinstance(health, dict) and "process_id" in health and "lifecycle" in health
        return Probed("0.3" if clear else "v1")
    if status == 0:
        return Probed(None, f"GET {url} had no answer within {restarts.HEALTH_TIMEOUT:g} s", passing=True)
    body = masked(orjson.dumps(health), server, "") if health is not None else "a body that is not JSON"
    return Probed(None, f"GET {url} answered {status}: {body}", passing=status == 429 or status >= 500)


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
            name = "NaN" if math.isnan(reward) else "Infinity" if reward > 0 else "-Infinity"
            return RemoteCompletion(
                rollout_id=rollout_id,
                status="ERROR",
                final_messages=messages,
                finish_reason="invalid_reward",
                error_message=f"the agent server reported a reward of {name}: not a finite number",
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
