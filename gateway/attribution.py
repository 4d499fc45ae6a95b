"""Which rollout a call belongs to. First match wins (docs/gateway.md):

1. the path prefix ``/rollout/{rollout_id}[/attempt/{attempt_id}]/v1/...``;
2. a rollout-scoped key ``Authorization: Bearer rk-...`` (minted with the claim);
3. the headers ``X-Rollout-Id`` / ``X-Attempt-Id``;
4. a ``rollout_id`` field in the JSON body (the Osmosis convention; never forwarded upstream);
5. none: the call is served and recorded as unattributed.

A call whose body carries ``rollout_id`` speaks the Osmosis protocol (``Attribution.osmosis``), whichever rule
attributed it: its answer gets TrainGate's top-level ``token_ids``, ``logprobs`` and ``prompt_token_ids``.
"""

from __future__ import annotations

import hmac
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import SecretStr

from rollway.gateway.errors import AuthError
from rollway.store import ApiKey, Store

Via = Literal["path", "key", "header", "body", "none"]
#: How long a key found is served from the cache. A revocation or another replica's catalog change empties it
#: (``forget``), so this bounds only a change no call here has seen the revision of; a key not found is asked
#: again after ``MISSING_KEY_TTL``.
KEY_CACHE_TTL = 60.0
MISSING_KEY_TTL = 5.0
KEY_CACHE_SIZE = 50_000


@dataclass(frozen=True)
class Attribution:
    rollout_id: str | None
    attempt_id: str | None
    via: Via
    osmosis: bool = False
    #: Span attributes the route adds (a controller's attempt id on ``/proxy/...``).
    tags: tuple[tuple[str, str], ...] = ()


def bearer(headers: dict[str, str]) -> str | None:
    value = headers.get("authorization", "")
    if value[:7].lower() == "bearer ":
        token = value[7:].strip()
        return token or None
    return None


class KeyCache:
    """Key lookups, cached so that a hot agent costs no store read per call (at a thousand agents, re-reading
    each key every few seconds was a tenth of the process's time). A revocation made through this process takes
    effect at once; one made through another replica once a call's arrival here reads the new catalog revision
    (the registry then calls ``forget``), at the latest after ``KEY_CACHE_TTL`` seconds.

    Entries are kept in the order they were cached; those past the TTL (never served again) are dropped from the
    front whenever a key is cached, so the cache holds about the last ``KEY_CACHE_TTL`` seconds' keys rather than
    every finished attempt's rollout key (up to ``KEY_CACHE_SIZE``)."""

    def __init__(self, store: Store, clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, ApiKey | None]] = OrderedDict()
        self._generation = 0  # moves on every forget: a lookup that began before one is not cached

    def __len__(self) -> int:
        return len(self._entries)

    async def find(self, plain: str) -> ApiKey | None:
        now = self._clock()
        hit = self._entries.get(plain)
        if hit is not None and now - hit[0] < (KEY_CACHE_TTL if hit[1] is not None else MISSING_KEY_TTL):
            key = hit[1]
            if key is None or key.expires_time is None or key.expires_time > self._store.clock():
                return key
            del self._entries[plain]  # expired while cached
            return None
        generation = self._generation
        found = await self._store.find_key(plain)
        if generation != self._generation:  # forgotten meanwhile: what it read may predate a revocation
            return await self._store.find_key(plain)
        self._entries[plain] = (now, found)
        self._entries.move_to_end(plain)
        self._prune(now)
        return found

    def prime(self, key: ApiKey, plain: str) -> None:
        """Cache a key this process just minted (a claim's rollout key): its agent's first call reads nothing."""
        now = self._clock()
        self._entries[plain] = (now, key)
        self._entries.move_to_end(plain)
        self._prune(now)

    def _prune(self, now: float) -> None:
        """Drop the oldest entries while they are past the TTL (or the cache is over its size)."""
        entries = self._entries
        while entries:
            cached_at = entries[next(iter(entries))][0]
            if now - cached_at < KEY_CACHE_TTL and len(entries) <= KEY_CACHE_SIZE:
                return
            entries.popitem(last=False)

    def forget(self, key_id: str | None = None) -> None:
        self._generation += 1
        if key_id is None:
            self._entries.clear()
            return
        for plain, (_, key) in list(self._entries.items()):
            if key is not None and key.key_id == key_id:
                del self._entries[plain]


async def check_key(headers: dict[str, str], keys: KeyCache, require_key: bool) -> ApiKey | None:
    """The caller's gateway or rollout key: checked when it is a rollout key or keys are required."""
    token = bearer(headers)
    if token is not None and (token.startswith("rk-") or require_key):
        key = await keys.find(token)
        if key is None or key.scope == "admin":
            raise AuthError("invalid, revoked or expired API key")
        return key
    if require_key:
        raise AuthError("an API key is required (Authorization: Bearer ...)")
    return None


def authenticated(headers: dict[str, str], key: ApiKey | None, admin_token: SecretStr | None) -> bool:
    """Whether a data-plane caller is authenticated: it sent a key the gateway checked (any key with
    ``ROLLWAY_GATEWAY_AUTH=keys``, a rollout key with ``none``) or the admin token; or no admin token is configured,
    when the server listens on loopback only and whoever reaches it is trusted as the admin API then trusts them.
    With an admin token and gateway auth ``none``, a caller without either is not."""
    if key is not None or admin_token is None:
        return True
    token = bearer(headers)
    return token is not None and hmac.compare_digest(token.encode(), admin_token.get_secret_value().encode())


def attribute(
    path_rollout: str | None,
    path_attempt: str | None,
    headers: dict[str, str],
    body: dict[str, Any],
    key: ApiKey | None,
) -> Attribution:
    """Resolve the call's rollout (see module docstring); ``key`` is the caller's, as ``check_key`` found it."""
    body_rollout = body.pop("rollout_id", None)
    osmosis = isinstance(body_rollout, str) and bool(body_rollout)
    if path_rollout is not None:
        found = Attribution(path_rollout, path_attempt, "path", osmosis)
    elif key is not None and key.scope == "rollout":
        found = Attribution(key.rollout_id, key.attempt_id, "key", osmosis)
    elif headers.get("x-rollout-id"):
        found = Attribution(headers["x-rollout-id"], headers.get("x-attempt-id") or None, "header", osmosis)
    elif osmosis:
        found = Attribution(str(body_rollout), None, "body", osmosis)
    else:
        found = Attribution(None, None, "none")
    if key is not None and key.scope == "rollout" and found.rollout_id != key.rollout_id:
        raise AuthError("this rollout key belongs to another rollout", status=403)
    if key is not None and key.scope == "rollout" and found.attempt_id not in (None, key.attempt_id):
        raise AuthError("this rollout key belongs to another attempt", status=403)
    if key is not None and key.scope == "rollout":
        return Attribution(found.rollout_id, key.attempt_id, found.via, osmosis)
    return found
