"""What the admin client hands back besides the store's models: its errors, its retry policy and the triplet
shapes of ``GET /admin/v1/triplets``.

Errors::

    RollwayError                 any failed call
     ├── RollwayAPIError         the server answered 4xx/5xx: ``status`` and the envelope's message/type/code
     │    └── WeightUpdateFailed the update failed or expired, resumed on the old version: its ``update``
     └── RollwayConnectionError  the server could not be reached (after the retries)
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict

from rollway.store.schemas import WeightUpdate


class RollwayError(Exception):
    """A call to the Rollway admin API failed."""


class RollwayAPIError(RollwayError):
    """The server answered with an error status; ``message`` etc. come from its OpenAI-style envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        code: str | None = None,
        param: str | None = None,
        method: str = "",
        url: str = "",
        body: Any = None,
    ) -> None:
        super().__init__(f"{status} {type or 'error'}: {message}")
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.method, self.url = method, url
        self.body = body  # the answer's JSON (None when it was not JSON)

    @classmethod
    def of(cls, response: httpx.Response) -> RollwayAPIError:
        error: Any = None
        body: Any = None
        with contextlib.suppress(ValueError, AttributeError):
            body = response.json()
            error = body.get("error")
        if not isinstance(error, dict):
            text = response.text.strip() or response.reason_phrase
            error = {"message": text[:500]}
        return cls(
            response.status_code,
            str(error.get("message") or response.reason_phrase),
            type=error.get("type"),
            code=error.get("code"),
            param=error.get("param"),
            method=response.request.method,
            url=str(response.request.url),
            body=body,
        )


class WeightUpdateFailed(RollwayAPIError):
    """A weight update failed or expired: the alias is back on its old version. ``update`` is its record (the
    engine calls it made, and why it failed)."""

    def __init__(self, error: RollwayAPIError, update: WeightUpdate) -> None:
        super().__init__(
            error.status,
            error.message,
            type=error.type,
            code=error.code,
            param=error.param,
            method=error.method,
            url=error.url,
            body=error.body,
        )
        self.update = update


class RollwayConnectionError(RollwayError):
    """The server could not be reached (connection refused, reset, timed out), even after the retries."""


@dataclass(frozen=True)
class RetryPolicy:
    """``retries`` more tries after the first; waits grow from ``backoff`` by 2x up to ``max_backoff``, each
    drawn from [w/2, w] (jitter), or the server's ``Retry-After`` when it gives one (capped likewise)."""

    retries: int = 3
    backoff: float = 0.25
    max_backoff: float = 5.0

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        if retry_after is not None:
            return min(max(retry_after, 0.0), self.max_backoff)
        ceiling = min(self.max_backoff, self.backoff * (2**attempt))
        return random.uniform(ceiling / 2, ceiling)


class Triplet(BaseModel):
    """One LLM call of a rollout with its reward (``GET /triplets``); unknown fields are kept."""

    model_config = ConfigDict(extra="allow")

    rollout_id: str
    attempt_id: str | None = None
    group_id: str | None = None
    sequence_id: int | None = None
    choice_index: int = 0
    prompt_token_ids: list[int] | None = None
    response_token_ids: list[int] | None = None
    response_logprobs: list[float] | None = None
    reward: float | None = None
    messages: Any = None
    prompt: Any = None
    response: Any = None
    model_version: str | None = None
    sampling: dict[str, Any] = {}
    finish_reason: str | None = None
    deduped_calls: int = 0  # calls of the rollout the export's de-duplication removed
    logprobs_source: Literal["sampled", "scored"] | None = None  # how the logprobs were had; None: incomplete
    logprobs_complete: bool | None = None  # one logprob for every response token (None: a server without it)
    remove_sample: bool = False  # the agent server asked to drop the rollout's sample


class MergedTriplet(BaseModel):
    """One multi-turn segment of a rollout (``GET /triplets?merge=true``); unknown fields are kept."""

    model_config = ConfigDict(extra="allow")

    rollout_id: str
    attempt_id: str | None = None
    group_id: str | None = None
    token_ids: list[int] = []
    loss_mask: list[int] = []
    logprobs: list[float] | None = None
    reward: float | None = None
    n_calls: int | None = None
    prefix_breaks: int | None = None
    model_version: str | None = None
    model_versions: list[str] = []
    sampling: dict[str, Any] = {}
    deduped_calls: int = 0  # calls of the rollout the export's de-duplication removed
    logprobs_source: Literal["sampled", "scored"] | None = None  # "scored": some call's were scored after it
    logprobs_complete: bool | None = None  # ``logprobs`` is there (None: a server without it)
    remove_sample: bool = False  # the agent server asked to drop the rollout's sample


class Unset:
    """Marks an argument that was not given (``update_attempt(metadata=...)`` may set ``None``)."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET = Unset()
