"""The data plane's errors, under one base. Each class's docstring says what it means::

    GatewayError
    ├── CallError         the call ends with this HTTP status and body (``CallError.of``: OpenAI's envelope)
    ├── ClientStalled     the client stopped taking the answer
    ├── AuthError         the call's key is refused (401, 403)
    ├── UnknownAlias      no model alias of that name (404)
    ├── AliasPaused       the alias stayed paused past the caller's wait (429)
    ├── UpstreamFailure   a try got no whole answer from its backend
    └── ResponseTooLarge  a backend's answer past ``ROLLWAY_MAX_RESPONSE_BYTES``

Only ``CallError`` reaches the client as it is; the ASGI layer (``gateway.dataplane``) and the call
(``gateway.call``) turn each of the others into one, and ``gateway.outcome`` turns every way a call ends into its
span. A store error is answered with the status of its kind (``rollway.envelope.STORE_ERROR_STATUS``).
"""

from __future__ import annotations

import orjson

from rollway.envelope import envelope, store_error_status
from rollway.store import StoreError


class GatewayError(Exception):
    """A call of the data plane could not go on."""


class CallError(GatewayError):
    """The call ends with this status and body (OpenAI's envelope, or the backend's own error body)."""

    def __init__(
        self,
        status: int,
        body: bytes,
        headers: list[tuple[bytes, bytes]] | None = None,
        error_type: str | None = None,
    ) -> None:
        super().__init__(body.decode(errors="replace"))
        self.status = status
        self.body = body
        self.headers = headers or []
        #: Why the call was refused, for its span (``model_paused``, ``model_busy``); ``http_<status>`` if None.
        self.error_type = error_type

    @classmethod
    def of(
        cls, status: int, message: str, type_: str, *, code: str | None = None, param: str | None = None
    ) -> CallError:
        """The call ends with ``status`` and ``message`` in the envelope."""
        return cls(status, orjson.dumps(envelope(message, type_, param=param, code=code)))

    @classmethod
    def of_store(cls, exc: StoreError) -> CallError:
        """A store error, answered with the status of its kind."""
        status, type_ = store_error_status(exc)
        return cls.of(status, exc.message, type_)


class ClientStalled(GatewayError):
    """The client took no part of the answer for ``ROLLWAY_WRITE_TIMEOUT`` seconds (or until the rollout's
    deadline): a reader that stopped reading without closing, a suspended agent. The call ends (its backend
    request closed, its slot and lease given back, its span written) and so does the connection."""


class AuthError(GatewayError):
    """The call's key is unknown, revoked or expired (401), or not allowed here (403)."""

    def __init__(self, message: str, status: int = 401) -> None:
        super().__init__(message)
        self.status = status

    def refusal(self) -> CallError:
        type_ = "authentication_error" if self.status == 401 else "permission_error"
        return CallError.of(self.status, str(self), type_, code="invalid_api_key")


class UnknownAlias(GatewayError):
    """No model alias of that name is registered."""

    def __init__(self, alias: str, known: list[str]) -> None:
        super().__init__(f"model '{alias}' does not exist")
        self.alias = alias
        self.known = known

    def refusal(self, listed: bool) -> CallError:
        """The 404; ``listed``: it names the aliases there are (to an authenticated caller only, see
        ``gateway.attribution.authenticated``)."""
        message = str(self)
        if listed:
            message += f"; known models: {', '.join(self.known) if self.known else 'none registered'}"
        return CallError.of(404, message, "not_found_error", code="model_not_found")


class AliasPaused(GatewayError):
    """The alias stayed paused longer than the caller may wait."""

    def __init__(self, alias: str, retry_after: float) -> None:
        super().__init__(f"model '{alias}' is paused; retry later")
        self.alias = alias
        self.retry_after = retry_after

    def refusal(self) -> CallError:
        err = CallError.of(429, str(self), "rate_limit_exceeded", code="model_paused")
        err.headers.append((b"retry-after", str(int(self.retry_after)).encode()))
        err.error_type = "model_paused"
        return err


class UpstreamFailure(GatewayError):
    """A try that got no (whole) HTTP response: ``kind`` is ``connect`` or ``broken`` (a whole answer's body broke
    off; both retried, failing over) or ``timeout`` / ``read_timeout`` / ``deadline`` / ``response_too_large`` /
    ``redirect`` (a 3xx, which is not followed)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class ResponseTooLarge(GatewayError):
    """A backend's answer (a whole body, or one event of a stream) past ``ROLLWAY_MAX_RESPONSE_BYTES``."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the backend's answer is larger than {limit} bytes")
