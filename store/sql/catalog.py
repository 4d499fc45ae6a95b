"""Model aliases (what clients put in ``model``) with their backends, and the catalog's revision.

Backend API keys (and agent servers', ``store.sql.agents``) are stored so the gateway can use them: in clear, or
encrypted with a ``Cipher`` when the store has a secret key (``Store.open(secret_key=...)``,
``ROLLWAY_SECRET_KEY``); the public ``Backend`` keeps them as ``SecretStr``, so they never print. Rollway's own
keys (gateway, rollout and admin keys) are ``store.sql.keys``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from sqlalchemy import Connection, delete, select, update

from rollway.store.controlled import ALIAS_ACTIONS
from rollway.store.db import models
from rollway.store.db.dialect import serialize_key
from rollway.store.errors import ConflictError, NotFoundError, StoreValidationError, UnavailableError
from rollway.store.schemas import Backend, ModelAlias
from rollway.store.sql.lifecycle import bump_counter

M = models.model_aliases
C = models.counters
#: The counter every change to model aliases or API keys moves forward, in the change's own transaction: a
#: gateway reads it in each call's arrival transaction, so a replica sees a swap, pause or revocation made
#: through another one on its next call rather than when its cache expires.
REVISION = "catalog"
#: An alias's control routes (``POST /admin/v1/models/{alias}/pause`` ...). Aliases may contain '/'
#: ("Qwen/Qwen2.5-7B"), so one whose last segment is one of these could not be told apart from its action.
ACTIONS = ALIAS_ACTIONS


def action_path(alias: str) -> tuple[str, str] | None:
    """``(alias, action)`` when ``alias`` ends in '/' + an action name ("policy/pause"), else None."""
    head, _, last = alias.rpartition("/")
    return (head, last) if head and last in ACTIONS else None


#: Where a backend's encrypted key is kept in its stored JSON (its ``api_key`` is then null), and an agent
#: server's in its row.
SEALED = "api_key_sealed"


class Cipher:
    """Encrypts the API keys the store keeps for others (backends', agent servers'), with Fernet (AES-128-CBC and
    HMAC-SHA256, ``cryptography``). ``secret``: a Fernet key (32 url-safe base64-encoded bytes,
    ``Fernet.generate_key()``), or several separated by commas: the first encrypts, each decrypts, so a key is
    replaced by putting the new one first (``seal_stored`` re-encrypts what an older one encrypted)."""

    def __init__(self, secret: str) -> None:
        try:
            self._fernets = [Fernet(part.strip()) for part in secret.split(",") if part.strip()]
        except ValueError:
            self._fernets = []
        if not self._fernets:
            raise StoreValidationError(
                "the secret key (ROLLWAY_SECRET_KEY) is not a Fernet key: 32 url-safe base64-encoded bytes, as "
                "printed by python -c 'from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())'"
            )
        self._all = MultiFernet(self._fernets)

    def seal(self, plain: str) -> str:
        return self._all.encrypt(plain.encode()).decode()

    def open(self, sealed: str, whose: str) -> str:
        """The key ``sealed`` holds; a key this cipher cannot decrypt (another secret key encrypted it, or the
        value was altered) is an ``UnavailableError`` naming ``whose`` it is, never a wrong key sent on."""
        try:
            return self._all.decrypt(sealed.encode()).decode()
        except InvalidToken:
            raise UnavailableError(f"{whose}: its stored api_key does not decrypt with this secret key") from None

    def resealed(self, sealed: str, whose: str) -> str | None:
        """``sealed`` encrypted again with the first key, when another one encrypted it; None when it is fine."""
        try:
            self._fernets[0].decrypt(sealed.encode())
            return None
        except InvalidToken:
            self.open(sealed, whose)  # (raises if no key decrypts it)
            return self._all.rotate(sealed.encode()).decode()


def stored_key(plain: str | None, cipher: Cipher | None) -> dict[str, str | None]:
    """The columns (or JSON fields) keeping ``plain``: in clear without a cipher, else encrypted."""
    if plain is None or cipher is None:
        return {"api_key": plain, SEALED: None}
    return {"api_key": None, SEALED: cipher.seal(plain)}


def read_key(stored: Mapping[Any, Any], cipher: Cipher | None, whose: str) -> str | None:
    """The key ``stored_key`` kept (a row, or a backend's JSON). An encrypted one needs the cipher: without it
    the key is an ``UnavailableError`` (another process with a secret key encrypted it), not a missing key."""
    sealed = stored.get(SEALED)
    if not sealed:
        plain: str | None = stored.get("api_key")
        return plain
    if cipher is None:
        raise UnavailableError(f"{whose}: its api_key is stored encrypted, and this process has no secret key")
    return cipher.open(sealed, whose)


def _backend_json(backend: Backend, cipher: Cipher | None) -> dict[str, Any]:
    data = backend.model_dump(mode="json")
    data.update(stored_key(backend.api_key.get_secret_value() if backend.api_key else None, cipher))
    if data[SEALED] is None:
        del data[SEALED]
    return data


def _backend(alias: str, data: dict[str, Any], cipher: Cipher | None) -> Backend:
    whose = f"backend '{data.get('backend_id')}' of model '{alias}'"
    fields = {k: v for k, v in data.items() if k != SEALED}
    return Backend.model_validate({**fields, "api_key": read_key(data, cipher, whose)})


def _alias(row: Any, cipher: Cipher | None) -> ModelAlias:
    return ModelAlias(
        alias=row["alias"],
        backends=[_backend(row["alias"], b, cipher) for b in row["backends"]],
        version=row["version"],
        sampling=row["sampling"],
        paused=row["paused"],
        created_time=row["created_time"],
        updated_time=row["updated_time"],
        update_id=row["update_id"],
        hold_until=row["hold_until"],
    )


def get_model(conn: Connection, alias: str, cipher: Cipher | None = None) -> ModelAlias:
    row = (conn.execute(select(M).where(M.c.alias == alias))).mappings().first()
    if row is None:
        raise NotFoundError(f"model '{alias}' not found")
    return _alias(row, cipher)


def revision(conn: Connection) -> int:
    """The catalog's revision (0 before its first change)."""
    value = conn.execute(select(C.c.value).where(C.c.name == REVISION)).scalar()
    return int(value or 0)


def bump_revision(conn: Connection) -> None:
    """Move the catalog revision forward: every replica reloads the aliases on its next call."""
    bump_counter(conn, REVISION)


def list_models(conn: Connection, cipher: Cipher | None = None) -> list[ModelAlias]:
    return [_alias(r, cipher) for r in (conn.execute(select(M).order_by(M.c.alias))).mappings()]


def put_model(
    conn: Connection,
    alias: str,
    backends: list[Backend],
    version: str | None,
    sampling: dict[str, Any] | None,
    now: float,
    cipher: Cipher | None = None,
) -> ModelAlias:
    """Create or replace an alias. Without an explicit version, a replaced alias gets its version + 1.

    Puts of one alias take turns (``serialize_key``: PostgreSQL's advisory lock on it; SQLite's single writer
    already orders them): two at once from two replicas would both find no alias and the second insert be
    refused as a duplicate, or both find version n and both write n + 1."""
    check_model(alias, backends)
    serialize_key(conn, "model:" + alias)
    row = (conn.execute(select(M).where(M.c.alias == alias))).mappings().first()
    if version is None:
        version = "1" if row is None else next_version(row["version"])
    values = {
        "backends": [_backend_json(b, cipher) for b in backends],
        "version": version,
        "sampling": sampling,
        "updated_time": now,
    }
    if row is None:
        conn.execute(M.insert().values(alias=alias, paused=False, created_time=now, **values))
    else:
        conn.execute(update(M).where(M.c.alias == alias).values(**values))
    bump_revision(conn)
    return get_model(conn, alias, cipher)


def check_model(alias: str, backends: list[Backend]) -> None:
    """Refuse (``StoreValidationError``) what ``put_model`` refuses, before anything is written: a name no URL
    path can hold, no backend, two with one id, a base URL no call could reach."""
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


def next_version(version: str) -> str:
    """The version after ``version``: its trailing number + 1, same width or wider ("7" → "8", "v2" → "v3",
    "step-099" → "step-100"); a version that does not end in a number gets one ("main" → "main+1")."""
    digits = len(version) - len(version.rstrip("0123456789"))
    if digits == 0:
        return f"{version}+1"
    head, number = version[:-digits], version[-digits:]
    return head + str(int(number) + 1).zfill(digits)


def set_paused(conn: Connection, alias: str, paused: bool, now: float, cipher: Cipher | None = None) -> ModelAlias:
    """Pause or resume ``alias``. A resume while a weight update holds it is a conflict: its calls would be
    served by weights that are being replaced (the update's commit or abort resumes it)."""
    if not paused:
        held = conn.execute(select(M.c.update_id).where(M.c.alias == alias)).scalar()
        if held is not None:
            raise ConflictError(f"model '{alias}' is held by weight update '{held}': commit or abort it to resume")
    result = conn.execute(update(M).where(M.c.alias == alias).values(paused=paused, updated_time=now))
    if result.rowcount == 0:
        raise NotFoundError(f"model '{alias}' not found")
    bump_revision(conn)
    return get_model(conn, alias, cipher)


def delete_model(conn: Connection, alias: str) -> None:
    if (conn.execute(delete(M).where(M.c.alias == alias))).rowcount == 0:
        raise NotFoundError(f"model '{alias}' not found")
    bump_revision(conn)


def seal_stored(conn: Connection, cipher: Cipher | None) -> int:
    """At start: with a cipher, encrypt the API keys stored in clear (backends', agent servers') and re-encrypt
    with its first key those an older key encrypted; how many were (re-)encrypted. Without one, a database that
    holds encrypted keys is refused. A key no secret key given decrypts is refused as well: a
    ``StoreValidationError`` saying so, before any call could be sent with it."""
    G = models.agent_servers
    aliases = list(conn.execute(select(M.c.alias, M.c.backends)).mappings())
    servers = list(conn.execute(select(G.c.name, G.c.api_key, G.c[SEALED])).mappings())
    if cipher is None:
        encrypted = sum(1 for row in servers if row[SEALED])
        encrypted += sum(1 for row in aliases for b in row["backends"] if b.get(SEALED))
        if encrypted:
            raise StoreValidationError(
                f"the database holds {encrypted} encrypted API key(s) and no secret key is set: set "
                "ROLLWAY_SECRET_KEY to the key that encrypted them"
            )
        return 0
    changed = 0
    for row in aliases:
        backends = [dict(b) for b in row["backends"]]
        for backend in backends:
            new = _sealed_again(backend, cipher, f"backend '{backend.get('backend_id')}' of model '{row['alias']}'")
            if new is not None:
                backend.update(api_key=None, **{SEALED: new})
                changed += 1
        if backends != row["backends"]:
            conn.execute(update(M).where(M.c.alias == row["alias"]).values(backends=backends))
    for row in servers:
        new = _sealed_again(row, cipher, f"agent server '{row['name']}'")
        if new is not None:
            conn.execute(update(G).where(G.c.name == row["name"]).values(api_key=None, **{SEALED: new}))
            changed += 1
    return changed


def _sealed_again(stored: Mapping[Any, Any], cipher: Cipher, whose: str) -> str | None:
    """What ``stored`` (a backend's JSON, an agent server's row) should now keep encrypted, None to leave it."""
    if stored.get(SEALED):
        try:
            return cipher.resealed(stored[SEALED], whose)
        except UnavailableError:
            raise StoreValidationError(
                f"the secret key (ROLLWAY_SECRET_KEY) does not decrypt the api_key of {whose}: it is not the key "
                "that encrypted the stored keys (give that one, or it after the new one, separated by a comma)"
            ) from None
    plain = stored.get("api_key")
    return cipher.seal(plain) if plain else None
