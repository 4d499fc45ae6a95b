"""The controlled proxy: the route Agent-lightning 1.0's agents call,
``POST /proxy/rollout/{rollout_id}/attempt/{attempt_id}/mode/{train|val}/openai/v1/{chat/completions|completions}``.

What it adds to an ordinary call of the data plane (``dataplane.DataPlane`` serves it through ``Call`` like any
other, so it is recorded as a span with its sequence id, streams included):

- the key the ``/api/*`` routes take (``rollway.agl.server.key_accepted``, handed in by the composition root): the
  admin token or an admin-scoped key, as ``Authorization: Bearer`` or ``x-api-key`` (401 otherwise), when a token
  is set;
- the rollout must be a controlled rollout that is not deleted (404);
- while the proxy is paused (``/proxy/pause``), 429 at once with ``Retry-After`` and ``X-Agl-Paused: true``, and
  nothing recorded;
- the model is forced: ``ROLLWAY_AGL_MODEL``, else the one model name registered through ``/api/models`` (a
  trainer's registered name); the call goes to its alias (``store.controlled.alias_for``), sticky per rollout as
  every call; 503 when no endpoint is registered for it;
- the temperature of the mode (train 1.0, val 0.7 by default), token ids always asked, and logprobs in train mode
  (``true`` for chat; for a text completion the integer vLLM wants, at least 1);
- the controller's attempt id goes on the span (``agl.attempt_id``): it selects whose events the rollout shows.

The pause and the registered models are cached for ``TTL`` seconds, and forgotten when this process changes them
or sees the catalog revision move (another replica changed them). A replica that has not seen a pause yet still
forwards nothing: the pause also pauses the aliases, whose calls then wait (``registry.admit``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

from rollway.gateway.errors import CallError
from rollway.store import Store
from rollway.store.controlled import EngineModel, ProxyPause, alias_for

PATH = re.compile(
    r"^/proxy/rollout/(?P<rollout>[^/]+)/attempt/(?P<attempt>[^/]+)/mode/(?P<mode>[^/]+)/openai/v1/(?P<op>.+?)/?$"
)
OPERATIONS = frozenset({"chat/completions", "completions"})
MODES = frozenset({"train", "val"})
TTL = 1.0
#: Whether a call's headers carry a key the Agent-lightning API takes.
KeyCheck = Callable[[dict[str, str]], Awaitable[bool]]


class ControlledProxy:
    def __init__(
        self,
        store: Store,
        accepts: KeyCheck,
        model: str | None,
        temperatures: dict[str, float],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._accepts = accepts
        self._model = model
        self._temperatures = temperatures
        self._clock = clock
        self._pause: tuple[float, ProxyPause] | None = None
        self._models: tuple[float, list[EngineModel]] | None = None

    def forget(self) -> None:
        """Read the pause and the models again at the next call."""
        self._pause = self._models = None

    async def check_auth(self, headers: dict[str, str]) -> None:
        """401 unless the call's key is one the ``/api/*`` routes take (a ``StoreError`` if keys cannot be read)."""
        if not await self._accepts(headers):
            raise CallError.of(401, "Invalid or missing API key", "authentication_error")

    async def pause(self) -> ProxyPause:
        now = self._clock()
        if self._pause is None or now - self._pause[0] >= TTL:
            self._pause = (now, await self._store.proxy_pause())
        return self._pause[1]

    async def _registered(self) -> list[EngineModel]:
        now = self._clock()
        if self._models is None or now - self._models[0] >= TTL:
            self._models = (now, await self._store.engine_models())
        return self._models[1]

    async def target(self) -> tuple[str, str]:
        """(the model name every call is sent to, its alias); 503 when none is registered."""
        registered = await self._registered()
        names = sorted({m.model for m in registered})
        name = self._model
        if name is None:
            if len(names) > 1:
                message = f"several models are registered ({', '.join(names)}): set ROLLWAY_AGL_MODEL to one"
                raise CallError.of(503, message, "service_unavailable")
            name = names[0] if names else None
        if name is None or name not in names:
            raise CallError.of(503, f"No servers available for model '{name or ''}'", "service_unavailable")
        return name, alias_for(name)

    def prepare(self, body: dict[str, Any], mode: str, op: str, alias: str) -> dict[str, Any]:
        """The body as the mode sends it (see the module docstring)."""
        prepared = body | {"model": alias, "temperature": self._temperatures[mode], "return_token_ids": True}
        if mode == "train":
            if op == "chat/completions":
                prepared["logprobs"] = True
            else:
                given = body.get("logprobs")
                asked = given if isinstance(given, int) and not isinstance(given, bool) else 0
                prepared["logprobs"] = max(1, asked)
        return prepared


def paused_error(state: ProxyPause) -> CallError:
    err = CallError.of(429, "gateway paused" + (f": {state.reason}" if state.reason else ""), "rate_limit_error")
    err.headers += [
        (b"retry-after", str(state.retry_after_seconds).encode()),
        (b"x-agl-paused", b"true"),
    ]
    return err
