"""Identifiers the store hands out (the Agent-lightning shapes: ``ro-`` + 12 hex, ``at-`` + 8 hex, ...)."""

from __future__ import annotations

import secrets


def rollout_id() -> str:
    return "ro-" + secrets.token_hex(6)


def attempt_id() -> str:
    return "at-" + secrets.token_hex(6)  # 48 bits: ids are unique across the whole store


def resources_id() -> str:
    return "rs-" + secrets.token_hex(6)


def group_id() -> str:
    return "gr-" + secrets.token_hex(6)


def key_id() -> str:
    return "key-" + secrets.token_hex(6)


def backend_id() -> str:
    return "be-" + secrets.token_hex(4)


def trace_id() -> str:
    return secrets.token_hex(16)


def span_id() -> str:
    return secrets.token_hex(8)
