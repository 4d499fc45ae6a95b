"""Rollway's own API keys: gateway, rollout and admin keys, random tokens shown once when they are minted and
stored only as SHA-256 digests (they carry 256 bits of entropy, so a fast hash is the right tool). A revocation
moves the catalog's revision (``store.sql.catalog``), so every replica drops the keys it cached."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, select, update

from rollway.store import ids
from rollway.store.db import models
from rollway.store.errors import NotFoundError, StoreValidationError
from rollway.store.schemas import ApiKey, AttemptedRollout, KeyScope
from rollway.store.sql.catalog import bump_revision

K = models.api_keys
KEY_PREFIXES: dict[str, str] = {"gateway": "sk-rw-", "rollout": "rk-", "admin": "ak-"}


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _key(row: Any) -> ApiKey:
    return ApiKey.model_validate({k: row[k] for k in ApiKey.model_fields})


def mint_key(
    conn: Connection,
    scope: KeyScope,
    now: float,
    *,
    name: str | None = None,
    rollout_id: str | None = None,
    attempt_id: str | None = None,
    expires_time: float | None = None,
) -> tuple[ApiKey, str]:
    """A new key: the stored record and the key itself (returned once, never stored in clear)."""
    if scope == "rollout" and not (rollout_id and attempt_id):
        raise StoreValidationError("a rollout key needs a rollout_id and an attempt_id")
    plain = KEY_PREFIXES[scope] + secrets.token_urlsafe(32)
    row = {
        "key_id": ids.key_id(),
        "key_hash": digest(plain),
        "prefix": plain[:10],
        "scope": scope,
        "name": name,
        "rollout_id": rollout_id,
        "attempt_id": attempt_id,
        "created_time": now,
        "expires_time": expires_time,
        "revoked_time": None,
    }
    conn.execute(K.insert().values(**row))
    return _key(row), plain


def attempt_keys(
    conn: Connection, handed: Sequence[AttemptedRollout], now: float, *, arrived: float | None = None
) -> list[tuple[ApiKey, str]]:
    """A rollout-scoped key for each attempt a claim or a start hands out (each key's record and the key).

    ``arrived``: when a request carrying an idempotency key arrived. An attempt it hands out that is older than
    that was made by an earlier try of the request, whose answer the client did not get (or gave up on): the
    key that answer carried cannot be sent again (only its hash is stored), so this answer carries a new one,
    and the keys minted for the attempt before the request arrived are revoked — one live key, this answer's.
    Keys minted after it arrived are left alone: they come from tries that overlapped this one (waiting for
    work together), and the client may hold any of their answers."""
    again = [a.attempt for a in handed if arrived is not None and a.attempt.start_time < arrived]
    if again:
        stale = update(K).where(
            K.c.rollout_id.in_({a.rollout_id for a in again}),  # (indexed)
            K.c.attempt_id.in_([a.attempt_id for a in again]),
            K.c.scope == "rollout",
            K.c.created_time < arrived,
            K.c.revoked_time.is_(None),
        )
        if conn.execute(stale.values(revoked_time=now)).rowcount:
            bump_revision(conn)  # every replica drops the keys it cached
    return [
        mint_key(conn, "rollout", now, rollout_id=a.rollout.rollout_id, attempt_id=a.attempt.attempt_id) for a in handed
    ]


def find_key(conn: Connection, plain: str, now: float) -> ApiKey | None:
    """The live key record for ``plain`` (None when unknown, revoked or expired)."""
    row = (conn.execute(select(K).where(K.c.key_hash == digest(plain)))).mappings().first()
    if row is None or row["revoked_time"] is not None:
        return None
    if row["expires_time"] is not None and row["expires_time"] <= now:
        return None
    return _key(row)


def revoke_key(conn: Connection, key_id: str, now: float) -> ApiKey:
    result = conn.execute(update(K).where(K.c.key_id == key_id, K.c.revoked_time.is_(None)).values(revoked_time=now))
    row = (conn.execute(select(K).where(K.c.key_id == key_id))).mappings().first()
    if row is None:
        raise NotFoundError(f"key '{key_id}' not found")
    if result.rowcount:
        bump_revision(conn)
    return _key(row)
