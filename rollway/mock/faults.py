"""Scripted faults and the mock's bookkeeping (request counts, in-flight, cancellations, recent requests).

A fault rule (JSON, ``POST /mock/faults``)::

    {"kind": "status", "status": 503, "body": {...}, "headers": {...}, "times": 1, "match": {...}}
    {"kind": "rate_limit", "retry_after": 1, "times": 1}
    {"kind": "drop_mid_stream", "after_chunks": 3}      # abort the connection after N SSE events
    {"kind": "stall_mid_stream", "after_chunks": 3}     # send N events, then nothing until the client leaves
    {"kind": "hang"}                                    # never answer until the client leaves
    {"kind": "delay", "ms": 500}                        # answer normally, ``ms`` later
    {"kind": "garbage_event", "after_chunks": 3, "body": "{not json"}  # one event whose data is not JSON

``times`` is how many requests the rule fires for (default 1; ``null`` for every request until removed).
``match`` (optional) narrows it: a string is a model name; an object may hold ``model``, ``path`` and
``stream`` (bool). Without ``path`` a rule matches only the generation routes (``POST /v1/...``), never
``/v1/models`` or ``/health``. The first rule that matches fires; ``drop_mid_stream`` on a non-streamed request
sends the headers and half the body, then aborts. ``garbage_event`` slips one ``data:`` event holding ``body``
(a string; default ``{not json``) into a stream after N events and then goes on; a non-streamed answer is
unchanged.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

FaultKind = Literal["status", "rate_limit", "drop_mid_stream", "stall_mid_stream", "hang", "delay", "garbage_event"]
KINDS: frozenset[str] = frozenset(FaultKind.__args__)  # type: ignore[attr-defined]
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"})

_rule_ids = itertools.count(1)


class FaultError(ValueError):
    """A rule that does not parse."""


def _number(raw: dict[str, Any], key: str, default: float, *, integer: bool = False) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise FaultError(f"{key} must be a non-negative number")
    if integer and int(value) != value:
        raise FaultError(f"{key} must be an integer")
    return float(value)


@dataclass(slots=True)
class FaultRule:
    kind: str
    times: int | None = 1
    status: int = 500
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    retry_after: float = 1.0
    after_chunks: int = 1
    ms: float = 0.0
    model: str | None = None
    path: str | None = None
    stream: bool | None = None
    id: int = 0
    fired: int = 0

    @classmethod
    def parse(cls, raw: Any) -> FaultRule:
        if not isinstance(raw, dict):
            raise FaultError("a fault rule must be a JSON object")
        unknown = set(raw) - {
            "kind",
            "times",
            "status",
            "body",
            "headers",
            "retry_after",
            "after_chunks",
            "ms",
            "match",
        }
        if unknown:
            raise FaultError(f"unknown fault rule keys: {sorted(unknown)}")
        kind = raw.get("kind")
        if kind not in KINDS:
            raise FaultError(f"kind must be one of {sorted(KINDS)}")
        times = raw.get("times", 1)
        if times is not None and (isinstance(times, bool) or not isinstance(times, int) or times < 1):
            raise FaultError("times must be a positive integer or null (unlimited)")
        status = int(_number(raw, "status", 429 if kind == "rate_limit" else 500, integer=True))
        if not 100 <= status <= 599:
            raise FaultError("status must be an HTTP status code")
        headers = raw.get("headers") or {}
        if not isinstance(headers, dict) or not all(isinstance(v, str) for v in headers.values()):
            raise FaultError("headers must be an object of strings")
        match = raw.get("match")
        model = path = None
        stream = None
        if isinstance(match, str):
            model = match
        elif isinstance(match, dict):
            model, path, stream = match.get("model"), match.get("path"), match.get("stream")
            if set(match) - {"model", "path", "stream"}:
                raise FaultError("match may hold model, path and stream")
            if (model is not None and not isinstance(model, str)) or (path is not None and not isinstance(path, str)):
                raise FaultError("match.model and match.path must be strings")
            if stream is not None and not isinstance(stream, bool):
                raise FaultError("match.stream must be a boolean")
        elif match is not None:
            raise FaultError("match must be a model name or an object")
        return cls(
            kind=kind,
            times=times,
            status=status,
            body=raw.get("body"),
            headers=dict(headers),
            retry_after=_number(raw, "retry_after", 1.0),
            after_chunks=int(_number(raw, "after_chunks", 1, integer=True)),
            ms=_number(raw, "ms", 0.0),
            model=model,
            path=path,
            stream=stream,
            id=next(_rule_ids),
        )

    def matches(self, *, path: str, model: str | None, stream: bool) -> bool:
        if self.path is None:
            if path not in GENERATION_PATHS:
                return False
        elif self.path != path:
            return False
        if self.model is not None and self.model != model:
            return False
        return self.stream is None or self.stream == stream

    @property
    def remaining(self) -> int | None:
        return None if self.times is None else self.times - self.fired

    def as_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"id": self.id, "kind": self.kind, "times": self.times, "fired": self.fired}
        data["remaining"] = self.remaining
        if self.kind == "status":
            data.update(status=self.status, body=self.body, headers=self.headers)
        elif self.kind == "rate_limit":
            data.update(status=self.status, retry_after=self.retry_after)
        elif self.kind in ("drop_mid_stream", "stall_mid_stream"):
            data["after_chunks"] = self.after_chunks
        elif self.kind == "delay":
            data["ms"] = self.ms
        data["match"] = {"model": self.model, "path": self.path, "stream": self.stream}
        return data


class FaultBook:
    """The scripted rules, consumed in order."""

    def __init__(self) -> None:
        self.rules: list[FaultRule] = []

    def add(self, raw: Any) -> list[FaultRule]:
        items = raw.get("rules", []) if isinstance(raw, dict) and "kind" not in raw else raw
        if isinstance(items, dict):
            items = [items]
        if not isinstance(items, list):
            raise FaultError("send a rule, a list of rules or {'rules': [...]}")
        parsed = [FaultRule.parse(item) for item in items]
        if isinstance(raw, dict) and raw.get("replace"):
            self.rules.clear()
        self.rules.extend(parsed)
        return parsed

    def take(self, *, path: str, model: str | None, stream: bool) -> FaultRule | None:
        for rule in self.rules:
            if rule.matches(path=path, model=model, stream=stream):
                rule.fired += 1
                if rule.remaining == 0:
                    self.rules.remove(rule)
                return rule
        return None

    def clear(self) -> None:
        self.rules.clear()


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    method: str
    path: str
    started_at: float
    model: str | None = None
    stream: bool = False
    status: int | None = None
    #: What the request is doing now: reading, waiting, hang, delay, generating, streaming, stalled.
    stage: str = "reading"
    fault: str | None = None
    cancelled: bool = False


class Stats:
    """Counts and lists for ``GET /mock/stats``; waiters are woken on every change."""

    def __init__(self, log_size: int = 1000) -> None:
        self.requests: dict[str, int] = {}
        self.statuses: dict[str, dict[str, int]] = {}
        self.in_flight: dict[str, RequestRecord] = {}
        self.cancelled: list[dict[str, Any]] = []
        self.faults_fired: list[dict[str, Any]] = []
        self.log: deque[dict[str, Any]] = deque(maxlen=log_size)
        self._changed = asyncio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def begin(self, record: RequestRecord) -> None:
        self.requests[record.path] = self.requests.get(record.path, 0) + 1
        self.in_flight[record.request_id + f"@{id(record)}"] = record
        self._notify()

    def end(self, record: RequestRecord) -> None:
        self.in_flight.pop(record.request_id + f"@{id(record)}", None)
        key = str(record.status) if record.status is not None else "none"
        per_path = self.statuses.setdefault(record.path, {})
        per_path[key] = per_path.get(key, 0) + 1
        self._notify()

    def cancel(self, record: RequestRecord, noticed_at: float) -> None:
        if record.cancelled:
            return
        record.cancelled = True
        self.cancelled.append(
            {
                "request_id": record.request_id,
                "path": record.path,
                "model": record.model,
                "stream": record.stream,
                "stage": record.stage,
                "fault": record.fault,
                "started_at": record.started_at,
                "noticed_at": noticed_at,
            }
        )
        self._notify()

    def fault_fired(self, record: RequestRecord, rule: FaultRule) -> None:
        record.fault = rule.kind
        self.faults_fired.append(
            {"rule_id": rule.id, "kind": rule.kind, "request_id": record.request_id, "at": time.monotonic()}
        )
        self._notify()

    async def wait_until(self, predicate: Any, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until ``predicate()`` is true; return whether it is."""
        deadline = time.monotonic() + timeout
        while not predicate():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            changed = self._changed
            try:
                async with asyncio.timeout(remaining):
                    await changed.wait()
            except TimeoutError:
                return bool(predicate())
        return True

    def snapshot(self) -> dict[str, Any]:
        by_status: dict[str, int] = {}
        for per_path in self.statuses.values():
            for status, count in per_path.items():
                by_status[status] = by_status.get(status, 0) + count
        return {
            "now": time.monotonic(),
            "requests_total": sum(self.requests.values()),
            "by_route": dict(self.requests),
            "by_status": by_status,
            "by_route_status": {path: dict(per) for path, per in self.statuses.items()},
            "in_flight": len(self.in_flight),
            "in_flight_requests": [
                {
                    "request_id": r.request_id,
                    "path": r.path,
                    "model": r.model,
                    "stage": r.stage,
                    "started_at": r.started_at,
                }
                for r in self.in_flight.values()
            ],
            "cancelled": list(self.cancelled),
            "faults_fired": list(self.faults_fired),
        }

    def reset(self) -> None:
        self.requests.clear()
        self.statuses.clear()
        self.cancelled.clear()
        self.faults_fired.clear()
        self.log.clear()
        self._notify()


def with_garbage(events: list[list[bytes]], rule: FaultRule) -> list[list[bytes]]:
    """``events`` with one more, whose data is the rule's ``body`` (not JSON), after ``after_chunks`` events."""
    data = rule.body if isinstance(rule.body, str) else "{not json"
    garbage = b"data: " + data.encode() + b"\n\n"
    out, seen = [], 0
    for step in events:
        cut = rule.after_chunks - seen
        out.append([*step[:cut], garbage, *step[cut:]] if 0 <= cut < len(step) else step)
        seen += len(step)
    return out
