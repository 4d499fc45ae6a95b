"""Model aliases (what clients put in ``model``) with their backends, and API keys.

Backend API keys are stored so the gateway can use them; the public ``Backend`` keeps them as
``SecretStr``, so they never print. Gateway and rollout keys are random tokens shown once at mint time and
stored only as SHA-256 digests (they carry 256 bits of entropy, so a fast hash is the right tool).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from sqlalchemy import Connection, delete, select, update

from rollway.store import ids, models
from rollway.store.dialect import serialize_key
from rollway.store.errors import NotFoundError, StoreValidationError
from rollway.store.lifecycle import bump_counter
from rollway.store.schemas import ApiKey, AttemptedRollout, Backend, KeyScope, ModelAlias

M = models.model_aliases
C = models.counters
#: The counter every change to model aliases or API keys moves forward, in the change's own transaction: a
#: gateway reads it in each call's arrival transaction, so a replica sees a swap, pause or revocation made
#: through another one on its next call rather than when its cache expires.
REVISION = "catalog"
#: An alias's control routes (``POST /admin/v1/models/{alias}/pause`` ...). Aliases may contain '/'
#: ("Qwen/Qwen2.5-7B"), so one whose last segment is one of these could not be told apart from its action.
ACTIONS = frozenset({"pause", "resume", "swap", "drain"})


def action_path(alias: str) -> tuple[str, str] | None:
    """``(alias, action)`` when ``alias`` ends in '/' + an action name ("policy/pause"), else None."""
    head, _, last = alias.rpartition("/")
    return (head, last) if head and last in ACTIONS else None


K = models.api_keys
KEY_PREFIXES: dict[str, str] = {"gateway": "sk-rw-", "rollout": "rk-", "admin": "ak-"}


def _backend_json(backend: Backend) -> dict[str, Any]:
    data = backend.model_dump(mode="json")
    data["api_key"] = backend.api_key.get_secret_value() if backend.api_key else None
    return data


def _alias(row: Any) -> ModelAlias:
    return ModelAlias(
        alias=row["alias"],
        backends=[Backend.model_validate(b) for b in row["backends"]],
        version=row["version"],
        sampling=row["sampling"],
        paused=row["paused"],
        created_time=row["created_time"],
        updated_time=row["updated_time"],
    )


def get_model(conn: Connection, alias: str) -> ModelAlias:
    row = (conn.execute(select(M).where(M.c.alias == alias))).mappings().first()
    if row is None:
        raise NotFoundError(f"model '{alias}' not found")
    return _alias(row)


def revision(conn: Connection) -> int:
    """The catalog's revision (0 before its first change)."""
    value = conn.execute(select(C.c.value).where(C.c.name == REVISION)).scalar()
    return int(value or 0)


def _changed(conn: Connection) -> None:
    bump_counter(conn, REVISION)


def list_models(conn: Connection) -> list[ModelAlias]:
    return [_alias(r) for r in (conn.execute(select(M).order_by(M.c.alias))).mappings()]


def put_model(
    conn: Connection,
    alias: str,
    backends: list[Backend],
    version: str | None,
    sampling: dict[str, Any] | None,
    now: float,
) -> ModelAlias:
    """Create or replace an alias. Without an explicit version, a replaced alias gets its version + 1.

    Puts of one alias take turns (``serialize_key``: PostgreSQL's advisory lock on it; SQLite's single writer
    already orders them): two at once from two replicas would both find no alias and the second insert be
    refused as a duplicate, or both find version n and both write n + 1."""
    if not alias:
        raise StoreValidationError("a model alias must not be empty")
    if not _addressable(alias):
        raise StoreValidationError(
            f"model alias '{alias[:80]}' cannot be addressed in a URL path: at most 256 printable characters "
            "without spaces at either end, and no empty, '.' or '..' part between '/'s"
        )
    if (action := action_path(alias)) is not None:
        raise StoreValidationError(
            f"model alias '{alias}' ends in '/{action[1]}', which names an action on the alias '{action[0]}'"
        )
    if not backends:
        raise StoreValidationError(f"model '{alias}' needs at least one backend")
    if len({b.backend_id for b in backends}) != len(backends):
        raise StoreValidationError(f"model '{alias}' has two backends with the same backend_id")
    for backend in backends:
        _check_base_url(backend)
    serialize_key(conn, "model:" + alias)
    row = (conn.execute(select(M).where(M.c.alias == alias))).mappings().first()
    if version is None:
        version = "1" if row is None else _next_version(row["version"])
    values = {
        "backends": [_backend_json(b) for b in backends],
        "version": version,
        "sampling": sampling,
        "updated_time": now,
    }
    if row is None:
        conn.execute(M.insert().values(alias=alias, paused=False, created_time=now, **values))
    else:
        conn.execute(update(M).where(M.c.alias == alias).values(**values))
    _changed(conn)
    return get_model(conn, alias)


def _addressable(alias: str) -> bool:
    """Whether ``alias`` can be a path in ``/admin/v1/models/{alias}``: '/' may separate parts (``Qwen/Qwen3-8B``),
    but a client or proxy normalizes away empty, '.' and '..' parts, and a control character cannot be sent."""
    return (
        len(alias) <= 256
        and alias == alias.strip()
        and alias.isprintable()
        and all(part not in ("", ".", "..") for part in alias.split("/"))
    )


def _check_base_url(backend: Backend) -> None:
    """A backend is called at ``base_url`` + the API path over HTTP: anything but an http(s) URL with a host
    would only fail on every call. Checked when an alias is put, not when one is read: an alias stored before
    this check still loads (and can be put again with a good URL)."""
    if holds_credentials(backend.base_url):
        raise StoreValidationError(
            f"backend '{backend.backend_id}' base_url must not hold credentials (user:password@host): "
            "give the backend's key as api_key, which is never shown"
        )
    try:
        url = urlsplit(backend.base_url)
        usable = url.scheme in ("http", "https") and bool(url.hostname)
    except ValueError:  # e.g. an unbalanced '[' in the host
        usable = False
    if not usable:
        raise StoreValidationError(
            f"backend '{backend.backend_id}' base_url must be an http:// or https:// URL with a host, "
            f"got '{backend.base_url}'"
        )


def holds_credentials(url: str) -> bool:
    """Whether ``url`` has a ``user[:password]@`` part: a secret that would be shown wherever the URL is (model
    listings, spans' ``server.address``, error messages)."""
    try:
        parts = urlsplit(url)
        return parts.username is not None or parts.password is not None
    except ValueError:
        return "@" in url


def _next_version(version: str) -> str:
    """The version after ``version``: its trailing number + 1, same width or wider ("7" → "8", "v2" → "v3",
    "step-099" → "step-100"); a version that does not end in a number gets one ("main" → "main+1")."""
    digits = len(version) - len(version.rstrip("0123456789"))
    if digits == 0:
        return f"{version}+1"
    head, number = version[:-digits], version[-digits:]
    return head + str(int(number) + 1).zfill(digits)


def set_paused(conn: Connection, alias: str, paused: bool, now: float) -> ModelAlias:
    result = conn.execute(update(M).where(M.c.alias == alias).values(paused=paused, updated_time=now))
    if result.rowcount == 0:
        raise NotFoundError(f"model '{alias}' not found")
    _changed(conn)
    return get_model(conn, alias)


def delete_model(conn: Connection, alias: str) -> None:
    if (conn.execute(delete(M).where(M.c.alias == alias))).rowcount == 0:
        raise NotFoundError(f"model '{alias}' not found")
    _changed(conn)


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
) -> list[str]:
    """A rollout-scoped key for each attempt a claim or a start hands out (the keys themselves).

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
            _changed(conn)  # every replica drops the keys it cached
    return [
        mint_key(conn, "rollout", now, rollout_id=a.rollout.rollout_id, attempt_id=a.attempt.attempt_id)[1]
        for a in handed
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
        _changed(conn)
    return _key(row)
