"""Identifiers the store hands out, in Agent-lightning's shapes (``ro-`` + 12 hex, ...); attempt ids get
12 hex digits rather than Agent-lightning's 8, so that they stay unique across the whole store."""

from __future__ import annotations

import hashlib
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


def derived(prefix: str, key: str, *parts: int) -> str:
    """An id of the usual shape made from a client's idempotency key (and positions in its request): the same
    key and positions give the same id, so a retried request finds what the first one made."""
    seed = "\x00".join([prefix, key, *map(str, parts)]).encode()
    return prefix + hashlib.sha256(seed).hexdigest()[:12]


def derived_hex(key: str, *parts: int | str, digits: int = 16) -> str:
    """A span id (16 hex digits) or trace id (32) made from a client's idempotency key and positions in its
    request, like ``derived``."""
    seed = "\x00".join(["hex", key, *map(str, parts)]).encode()
    return hashlib.sha256(seed).hexdigest()[:digits]
