"""An async Python client for the admin API (``/admin/v1``), with typed results (the store's and
``admin.schemas``' pydantic models) and retries.

    async with AsyncRollwayClient("http://127.0.0.1:8080", token="...") as client:
        rollouts = await client.enqueue([{"input": {"q": "1 + 1"}, "group_size": 4}])
        [claim] = await client.claim("worker-1", wait_seconds=10)

Connection errors and 5xx answers are retried with exponential backoff and jitter (``RetryPolicy``), a 4xx
never. A request that may have been done on the server (its answer lost, or a 5xx other than Rollway's 503,
which means nothing was written) is sent again only when that is harmless: reads; writes that set a state
(cancel, pause/resume; a heartbeat or attempt status that names its attempt, not ``latest``); and the writes
that carry an ``Idempotency-Key`` — enqueues, claims, starts, new attempts, rewards and spans — so a retry
neither queues tasks twice, takes or starts rollouts nobody runs, nor records a reward or span twice. The
others (mint a key, add resources, swap) are sent again only when they never left. Failures raise ``RollwayAPIError``
(status + the error envelope's message) or ``RollwayConnectionError``, both ``RollwayError``
(``admin.client_types``).

``admin.client_sync.RollwayClient`` is the same client for synchronous code.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal

import httpx

from rollway.admin.client_batch import AttemptBatcher
from rollway.admin.client_exports import ExportsMixin
from rollway.admin.client_models import ModelsMixin
from rollway.admin.client_transport import Transport, dump_body, path_segment, query
from rollway.admin.client_types import (
    UNSET,
    MergedTriplet,
    RetryPolicy,
    RollwayAPIError,
    RollwayConnectionError,
    RollwayError,
    Triplet,
    Unset,
    WeightUpdateFailed,
)
from rollway.admin.client_updates import UpdatesMixin
from rollway.admin.schemas import (
    AgentPage,
    AgentView,
    Claim,
    ClaimsResponse,
    GroupView,
    MintedKey,
    ResourcesPage,
    RolloutPage,
    RolloutsResponse,
    SpanPage,
    SpansResponse,
    StatsView,
    UnattributedSpanPage,
    WaitResponse,
)
from rollway.store import Attempt, ResourcesUpdate, Rollout, Span, TaskSpec, WeightUpdate

DEFAULT_URL = "http://127.0.0.1:8080"
MAX_WAIT_SECONDS = 60.0  # the server's bound on one long poll (claims, waits)
MAX_WAIT_IDS = 10_000  # the server's bound on rollout ids per wait


def _fresh_key() -> dict[str, str]:
    """The header that makes a write safe to retry: one key per call, sent again on its retries."""
    return {"Idempotency-Key": uuid.uuid4().hex}


class AsyncRollwayClient(ExportsMixin, ModelsMixin, UpdatesMixin):
    """The admin API of one Rollway server. ``url`` is the server's root (``/admin/v1`` is added); ``token`` is
    the admin token. Use as an async context manager, or call ``aclose()``."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        token: str | None = None,
        *,
        timeout: float = 30.0,
        retry: RetryPolicy | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/").removesuffix("/admin/v1")
        self._t = Transport(self.url, token, timeout=timeout, retry=retry or RetryPolicy(), transport=transport)
        self._updates = AttemptBatcher(self._t)  # the attempt updates sent at once, in one request

    @classmethod
    def from_env(cls, **kwargs: Any) -> AsyncRollwayClient:
        """``ROLLWAY_URL`` (default http://127.0.0.1:8080) and ``ROLLWAY_ADMIN_TOKEN``."""
        return cls(os.environ.get("ROLLWAY_URL", DEFAULT_URL), os.environ.get("ROLLWAY_ADMIN_TOKEN"), **kwargs)

    async def aclose(self) -> None:
        await self._t.aclose()

    async def __aenter__(self) -> AsyncRollwayClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # -- tasks, claims, rollouts -----------------------------------------------------------------------------

    async def enqueue(self, tasks: Sequence[TaskSpec | Mapping[str, Any]]) -> list[Rollout]:
        """Queue tasks (``group_size: n`` → n rollouts sharing a ``group_id``). Sent with a fresh
        ``Idempotency-Key``: a retry after a lost answer gets the rollouts the first try queued, not copies."""
        body = {"tasks": [dump_body(t) for t in tasks]}
        return (await self._t.model(RolloutsResponse, "POST", "/rollouts", json=body, headers=_fresh_key())).rollouts

    async def start_rollout(self, task: TaskSpec | Mapping[str, Any], worker_id: str | None = None) -> Claim:
        """Create a rollout with attempt 1 already handed to ``worker_id`` (no queue); a ``group_id`` with a
        ``group_size`` makes it a member of that group, of that size (one rollout per call). Sent with a fresh
        ``Idempotency-Key``: a retry after a lost answer gets that rollout, not a second one."""
        body = dump_body(task) | ({"worker_id": worker_id} if worker_id is not None else {})
        return await self._t.model(Claim, "POST", "/rollouts/start", json=body, headers=_fresh_key())

    async def claim(
        self,
        worker_id: str | None = None,
        limit: int = 1,
        wait_seconds: float = 0.0,
        *,
        mode: str | None = None,
        group_id: str | None = None,
        metadata: Mapping[str, str | int | float | bool] | None = None,
    ) -> list[Claim]:
        """Take up to ``limit`` queued rollouts, waiting up to ``wait_seconds`` (≤ 60) for one to arrive; with
        ``mode``, ``group_id`` or ``metadata`` (each key at that value), only the rollouts they name. Sent with a
        fresh ``Idempotency-Key``: a retry after a lost answer gets the rollouts the first try took."""
        body: dict[str, Any] = {"worker_id": worker_id, "limit": limit, "wait_seconds": wait_seconds}
        for name, value in (("mode", mode), ("group_id", group_id), ("metadata", metadata)):
            if value is not None:
                body[name] = dict(value) if isinstance(value, Mapping) else value
        claimed = await self._t.model(
            ClaimsResponse, "POST", "/claims", json=body, wait=wait_seconds, headers=_fresh_key()
        )
        return claimed.claims

    async def list_rollouts(
        self,
        *,
        status: str | Sequence[str] | None = None,
        mode: str | None = None,
        group_id: str | None = None,
        started_after: float | None = None,
        started_before: float | None = None,
        model: str | None = None,
        order: Literal["asc", "desc"] = "asc",
        limit: int = 100,
        cursor: str | None = None,
    ) -> RolloutPage:
        """One page of rollouts in creation order, oldest first (``order="desc"``: newest first; a cursor pages on
        in the order it was given with). ``started_*``: Unix seconds, ``after`` inclusive; ``model``: only
        rollouts that called this model alias."""
        statuses = [status] if isinstance(status, str) else list(status or [])
        params = query(
            status=statuses or None,
            mode=mode,
            group_id=group_id,
            started_after=started_after,
            started_before=started_before,
            model=model,
            order=order,
            limit=limit,
            cursor=cursor,
        )
        return await self._t.model(RolloutPage, "GET", "/rollouts", params=params)

    async def iter_rollouts(
        self,
        *,
        status: str | Sequence[str] | None = None,
        mode: str | None = None,
        group_id: str | None = None,
        started_after: float | None = None,
        started_before: float | None = None,
        model: str | None = None,
        order: Literal["asc", "desc"] = "asc",
        page_size: int = 500,
    ) -> AsyncIterator[Rollout]:
        """Every matching rollout, following the cursor page by page."""
        cursor: str | None = None
        while True:
            page = await self.list_rollouts(
                status=status,
                mode=mode,
                group_id=group_id,
                started_after=started_after,
                started_before=started_before,
                model=model,
                order=order,
                limit=page_size,
                cursor=cursor,
            )
            for rollout in page.items:
                yield rollout
            if not page.next_cursor or not page.items:
                return
            cursor = page.next_cursor

    async def get_rollout(self, rollout_id: str) -> Rollout:
        """The rollout with its ``attempts``."""
        return await self._t.model(Rollout, "GET", f"/rollouts/{path_segment(rollout_id)}")

    async def cancel(self, rollout_id: str) -> Rollout:
        """Cancel a rollout (cancelling a cancelled one again changes nothing)."""
        return await self._t.model(Rollout, "POST", f"/rollouts/{path_segment(rollout_id)}/cancel", repeatable=True)

    async def new_attempt(self, rollout_id: str, worker_id: str | None = None) -> Claim:
        """Start a new attempt of the rollout (the previous one becomes stale). Sent with a fresh
        ``Idempotency-Key``: a retry after a lost answer gets that attempt, not a second one."""
        path, body = f"/rollouts/{path_segment(rollout_id)}/attempts", {"worker_id": worker_id}
        return await self._t.model(Claim, "POST", path, json=body, headers=_fresh_key())

    async def update_attempt(
        self,
        rollout_id: str,
        attempt_id: str = "latest",
        *,
        status: str | None = None,
        metadata: Mapping[str, Any] | Unset | None = UNSET,
        reward: float | Unset | None = UNSET,
        reward_name: str = "primary",
    ) -> Attempt:
        """Report an attempt's outcome (``succeeded``/``failed``) and/or replace its metadata. With ``reward``,
        the reward is recorded in the same request and transaction (``add_reward`` records one alone): an
        agent's end is one request, ``update_attempt(rid, aid, status="succeeded", reward=r)``.

        An update that names its attempt is sent with the others this client's agents send at the same time, in
        one request (``client_batch``); it is safe to send again (a reward goes with its own idempotency key).
        The ``latest`` form is sent alone and once: by the time it is sent again, the latest attempt may be
        another worker's."""
        body: dict[str, Any] = {} if status is None else {"status": status}
        if not isinstance(metadata, Unset):
            body["metadata"] = None if metadata is None else dict(metadata)
        if not isinstance(reward, Unset):
            body |= {"reward": reward, "reward_name": reward_name}
        if attempt_id != "latest":
            change = {"rollout_id": rollout_id, "attempt_id": attempt_id, **body}
            if "reward" in body:
                change["idempotency_key"] = uuid.uuid4().hex
            return await self._updates.submit(change)
        return await self._t.model(
            Attempt,
            "PATCH",
            f"/rollouts/{path_segment(rollout_id)}/attempts/latest",
            json=body,
        )

    async def heartbeat(self, rollout_id: str, attempt_id: str = "latest") -> Attempt:
        return await self._t.model(
            Attempt,
            "POST",
            f"/rollouts/{path_segment(rollout_id)}/attempts/{path_segment(attempt_id)}/heartbeat",
            repeatable=attempt_id != "latest",
        )

    async def add_reward(
        self, rollout_id: str, value: float | None, *, name: str = "primary", attempt_id: str = "latest"
    ) -> Span:
        """Record a reward as a span on the attempt (``None`` stays null, never 0). Sent with a fresh
        ``Idempotency-Key``: a retry after a lost answer does not record it twice."""
        body, path = (
            {"value": value, "name": name, "attempt_id": attempt_id},
            f"/rollouts/{path_segment(rollout_id)}/rewards",
        )
        return await self._t.model(Span, "POST", path, json=body, headers=_fresh_key())

    async def add_spans(self, rollout_id: str, spans: Sequence[Span | Mapping[str, Any]]) -> list[Span]:
        """Add spans (missing sequence ids are assigned). Sent with a fresh ``Idempotency-Key``: returns every
        span as stored, and a retry after a lost answer writes none of them twice."""
        body, path = {"spans": [dump_body(s) for s in spans]}, f"/rollouts/{path_segment(rollout_id)}/spans"
        return (await self._t.model(SpansResponse, "POST", path, json=body, headers=_fresh_key())).spans

    async def get_spans(self, rollout_id: str, attempt_id: str = "latest") -> list[Span]:
        """Spans in sequence order; ``attempt_id`` is ``latest``, ``all`` or an attempt id."""
        params, path = {"attempt_id": attempt_id}, f"/rollouts/{path_segment(rollout_id)}/spans"
        return (await self._t.model(SpanPage, "GET", path, params=params)).items

    async def get_unattributed_spans(self, limit: int = 100, cursor: str | None = None) -> UnattributedSpanPage:
        """Spans of calls that named no rollout, in arrival order; pass ``next_cursor`` back for the next page."""
        params = query(limit=limit, cursor=cursor)
        return await self._t.model(UnattributedSpanPage, "GET", "/spans/unattributed", params=params)

    async def wait(self, rollout_ids: Sequence[str], timeout_seconds: float = 10.0) -> WaitResponse:
        """One server-side wait (``timeout_seconds`` ≤ 60) until the rollouts finish."""
        body = {"rollout_ids": list(rollout_ids), "timeout_seconds": timeout_seconds}
        return await self._t.model(
            WaitResponse, "POST", "/rollouts/wait", json=body, wait=timeout_seconds, repeatable=True
        )

    async def wait_for(self, rollout_ids: Sequence[str], timeout: float | None = None) -> WaitResponse:
        """Wait any number of rollouts for any time (``None``: until all finished), in bounded server waits."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        pending, finished = list(dict.fromkeys(rollout_ids)), []
        while pending:
            left = MAX_WAIT_SECONDS if deadline is None else max(0.0, deadline - loop.time())
            result = await self.wait(pending[:MAX_WAIT_IDS], min(left, MAX_WAIT_SECONDS))
            finished.extend(result.finished)
            pending = result.pending + pending[MAX_WAIT_IDS:]
            if deadline is not None and loop.time() >= deadline:
                break
        return WaitResponse(finished=finished, pending=pending)

    async def get_group(self, group_id: str) -> GroupView:
        return await self._t.model(GroupView, "GET", f"/groups/{path_segment(group_id)}")

    # -- resources -------------------------------------------------------------------------------------------

    async def add_resources(self, resources: Mapping[str, Any]) -> ResourcesUpdate:
        """A new bundle (version 1); it becomes the latest."""
        return await self._t.model(ResourcesUpdate, "POST", "/resources", json={"resources": dict(resources)})

    async def update_resources(self, resources_id: str, resources: Mapping[str, Any]) -> ResourcesUpdate:
        """A new version (+1) of an existing bundle; it becomes the latest (an unknown id: 404, `add_resources`
        makes a new one)."""
        body = {"resources": dict(resources)}
        return await self._t.model(ResourcesUpdate, "PUT", f"/resources/{path_segment(resources_id)}", json=body)

    async def get_resources(self, resources_id: str = "latest") -> ResourcesUpdate:
        return await self._t.model(ResourcesUpdate, "GET", f"/resources/{path_segment(resources_id)}")

    async def list_resources(self, limit: int = 100, cursor: str | None = None) -> ResourcesPage:
        return await self._t.model(ResourcesPage, "GET", "/resources", params=query(limit=limit, cursor=cursor))

    # -- remote agent servers -------------------------------------------------------------------------------

    async def list_agents(self) -> list[AgentView]:
        return (await self._t.model(AgentPage, "GET", "/agents")).items

    async def get_agent(self, name: str) -> AgentView:
        return await self._t.model(AgentView, "GET", f"/agents/{path_segment(name)}")

    async def put_agent(
        self,
        name: str,
        url: str,
        *,
        api_key: str | None = None,
        max_concurrent: int | None = None,
        completion_params: Mapping[str, Any] | None = None,
        protocol: Literal["v1", "0.3"] | None = None,
    ) -> AgentView:
        """Register (or replace) a remote agent server (Osmosis protocol); ``api_key`` is sent, never shown.
        ``protocol`` is the one it speaks (else Rollway tells it from the server's ``/health``)."""
        body = {"url": url} | query(
            api_key=api_key,
            max_concurrent=max_concurrent,
            completion_params=None if completion_params is None else dict(completion_params),
            protocol=protocol,
        )
        return await self._t.model(AgentView, "PUT", f"/agents/{path_segment(name)}", json=body)

    async def delete_agent(self, name: str) -> None:
        await self._t.request("DELETE", f"/agents/{path_segment(name)}")

    # -- keys, stats -----------------------------------------------------------------------------------------

    async def mint_key(
        self,
        scope: Literal["gateway", "admin"] = "gateway",
        *,
        name: str | None = None,
        expires_in_seconds: float | None = None,
    ) -> MintedKey:
        """A new key; ``key`` is shown only in this answer."""
        body = {"scope": scope} | query(name=name, expires_in_seconds=expires_in_seconds)
        return await self._t.model(MintedKey, "POST", "/keys", json=body)

    async def revoke_key(self, key_id: str) -> None:
        await self._t.request("DELETE", f"/keys/{path_segment(key_id)}")

    async def stats(self) -> StatsView:
        return await self._t.model(StatsView, "GET", "/stats")


__all__ = [
    "UNSET",
    "AsyncRollwayClient",
    "Claim",
    "MergedTriplet",
    "RetryPolicy",
    "RollwayAPIError",
    "RollwayConnectionError",
    "RollwayError",
    "Triplet",
    "Unset",
    "WeightUpdate",
    "WeightUpdateFailed",
]
