"""Normalising results of the Agent-lightning scenarios so runs against two servers can be compared: ids become
their order of first appearance (``ro#1``, ``at#2``...), times become ``"T"`` (or stay ``None``)."""

from __future__ import annotations

import re
from typing import Any

TIMES = frozenset(
    {
        "start_time",
        "end_time",
        "create_time",
        "update_time",
        "last_heartbeat_time",
        "last_dequeue_time",
        "last_busy_time",
        "last_idle_time",
        "uptime",
    }
)
ID = re.compile(r"(ro|at|rs)-[0-9a-f]+")


def normalise(value: Any, ids: dict[str, str] | None = None) -> Any:
    ids = {} if ids is None else ids
    if isinstance(value, dict):
        return {k: (("T" if v is not None else None) if k in TIMES else normalise(v, ids)) for k, v in value.items()}
    if isinstance(value, list):
        return [normalise(v, ids) for v in value]
    if isinstance(value, str) and ID.fullmatch(value):
        if value not in ids:
            kind = value[:2]
            ids[value] = f"{kind}#{sum(1 for v in ids.values() if v.startswith(kind)) + 1}"
        return ids[value]
    return value


def differences(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    a_ids: dict[str, str] = {}
    b_ids: dict[str, str] = {}
    out = {}
    for key in dict.fromkeys([*ours, *theirs]):
        a = normalise(ours.get(key), a_ids)
        b = normalise(theirs.get(key), b_ids)
        if a != b:
            out[key] = (a, b)
    return out
