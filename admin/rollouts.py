"""Tasks, claims, rollouts, attempts, rewards, spans, waits and groups (``/admin/v1``): thin routes over the
store."""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, HTTPException, Query, Request

from rollway.admin.context import AdminContext, Context
from rollway.admin.groups import COUNTED, answers_of, health_of
from rollway.admin.route import AdminRoute
from rollway.admin.schemas import (
    AttemptChange,
    AttemptChanges,
    AttemptRequest,
    AttemptResult,
    AttemptResults,
    AttemptUpdate,
    Claim,
    ClaimRequest,
    ClaimsResponse,
    EnqueueRequest,
    GroupHealth,
    GroupView,
    RewardRequest,
    RolloutPage,
    RolloutRow,
    RolloutsResponse,
    SpanPage,
    SpansRequest,
    SpansResponse,
    StartRequest,
    UnattributedSpanPage,
    WaitRequest,
    WaitResponse,
)
from rollway.envelope import envelope, store_error_status
from rollway.store import UNSET, Attempt, AttemptedRollout, Rollout, RolloutStatus, Span, Store, TaskSpec, ids
from rollway.store.errors import StoreError, UnavailableError
from rollway.store.exports import REWARD_SPAN, REWARD_STAMPED
from rollway.store.schemas import Mode

router = APIRouter(tags=["rollouts"], route_class=AdminRoute)

#: A client's key for one logical request, the same on its retries (``Idempotency-Key``).
IdempotencyKey = Annotated[str | None, Header(alias="Idempotency-Key", min_length=1, max_length=200)]


async def to_claim(
    context: AdminContext,
    request: Request,
    attempted: AttemptedRollout,
    key: str | None = None,
    *,
    arrived: float | None = None,
) -> Claim:
    """The claim a worker gets: the attempt's gateway URL and a key that only works for that attempt (minted
    here unless the claim already came with one; ``arrived``: when a keyed start arrived, see
    ``Store.mint_attempt_key``)."""
    rollout_id, attempt_id = attempted.rollout.rollout_id, attempted.attempt.attempt_id
    base = (context.public_url or str(request.base_url)).rstrip("/")
    if key is None:
        key = await context.store.mint_attempt_key(attempted, arrived=arrived)
    return Claim(
        rollout=attempted.rollout,
        attempt=attempted.attempt,
        resources=attempted.resources,
        base_url=f"{base}/rollout/{rollout_id}/attempt/{attempt_id}/v1",
        api_key=key,
    )


@router.post("/rollouts", status_code=201, response_model=RolloutsResponse)
async def enqueue(
    body: EnqueueRequest,
    context: Context,
    idempotency_key: IdempotencyKey = None,
) -> RolloutsResponse:
    """Queue tasks; `group_size: n` makes n rollouts sharing a `group_id`; a known `rollout_id` is idempotent.
    Tasks naming an existing `group_id` join that group (next `group_index`); several tasks of the request
    naming one `group_id`, all with the same `group_size: n`, are one rollout each in a group of size n.

    With an `Idempotency-Key` header, sending the same request again (a retry after a lost answer) returns the
    rollouts the first one queued instead of queueing the tasks twice; the key with other tasks is a 409."""
    return RolloutsResponse(rollouts=await context.store.enqueue(body.tasks, idempotency_key))


@router.post("/rollouts/start", status_code=201, response_model=Claim)
async def start(
    body: StartRequest, context: Context, request: Request, idempotency_key: IdempotencyKey = None
) -> Claim:
    """Create a rollout with attempt 1 already running for `worker_id` (online learning; no queue). With an
    `Idempotency-Key` header (and no `rollout_id`), the same request again returns that rollout (with a new
    gateway key; the one the earlier answer carried is revoked) instead of starting another.

    With `group_id` it joins that group at the next `group_index`; `group_size` then declares the group's size
    (it is complete, and exported, once that many members finished): a group with members and another size, or
    already that many members, is a 400."""
    arrived = None if idempotency_key is None else context.store.clock()
    task = TaskSpec.model_validate(body.model_dump(exclude={"worker_id"}))
    started = await context.store.start_rollout(task, body.worker_id, idempotency_key)
    return await to_claim(context, request, started, arrived=arrived)


@router.post("/claims", response_model=ClaimsResponse)
async def claim(
    body: ClaimRequest, context: Context, request: Request, idempotency_key: IdempotencyKey = None
) -> ClaimsResponse:
    """Take up to `limit` queued rollouts, waiting up to `wait_seconds` (≤ 60) for work to arrive.

    With an `Idempotency-Key` header, the same claim again returns the rollouts the first one took (with new
    gateway keys; those the earlier answer carried are revoked) instead of taking more; the key from another
    worker is a 409. `mode`, `group_id` and `metadata` take only the rollouts they name (a training worker's
    claim leaves the evaluation rollouts to the evaluators)."""
    claimed = await context.store.claim_with_keys(
        body.worker_id, body.limit, body.wait_seconds, idempotency_key, where=body.where()
    )
    return ClaimsResponse(claims=[await to_claim(context, request, c, key) for c, key in claimed])


@router.get("/rollouts", response_model=RolloutPage)
async def list_rollouts(
    context: Context,
    status: Annotated[list[RolloutStatus] | None, Query()] = None,
    mode: Mode | None = None,
    group_id: str | None = None,
    started_after: Annotated[float | None, Query(description="start_time >= this (Unix seconds)")] = None,
    started_before: Annotated[float | None, Query(description="start_time < this (Unix seconds)")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    cursor: str | None = None,
    model: Annotated[str | None, Query(min_length=1, max_length=256, description="called this alias")] = None,
    order: Annotated[Literal["asc", "desc"], Query(description="creation order: oldest or newest first")] = "asc",
) -> RolloutPage:
    """Rollouts in creation order (`order=desc`: newest first), filtered by status, mode, group, creation time
    and the model alias they called (`model`: a span of the rollout names it); `next_cursor` pages on in the
    same order (pass the same `order` with it)."""
    filters: dict[str, Any] = {"status": status, "mode": mode, "group_id": group_id, "limit": limit, "cursor": cursor}
    filters |= {"started_after": started_after, "started_before": started_before, "called_model": model}
    filters["descending"] = order == "desc"
    page = await context.store.list_rollouts(**filters)
    rewards = await context.store.primary_rewards([r.rollout_id for r in page.items])
    items = [RolloutRow(**r.model_dump(), reward=rewards.get(r.rollout_id)) for r in page.items]
    return RolloutPage(items=items, next_cursor=page.next_cursor)


@router.post("/rollouts/wait", response_model=WaitResponse)
async def wait(body: WaitRequest, context: Context) -> WaitResponse:
    """Block until every rollout finished or `timeout_seconds` (≤ 60) passed."""
    finished, pending = await context.store.wait_for_rollouts(body.rollout_ids, body.timeout_seconds)
    return WaitResponse(finished=finished, pending=pending)


@router.get("/rollouts/{rollout_id}", response_model=Rollout)
async def get_rollout(rollout_id: str, context: Context) -> Rollout:
    return await context.store.get_rollout(rollout_id, with_attempts=True)


@router.post("/rollouts/{rollout_id}/cancel", response_model=Rollout)
async def cancel(rollout_id: str, context: Context) -> Rollout:
    return await context.store.cancel(rollout_id)


@router.post("/rollouts/{rollout_id}/attempts", status_code=201, response_model=Claim)
async def new_attempt(
    rollout_id: str, body: AttemptRequest, context: Context, request: Request, idempotency_key: IdempotencyKey = None
) -> Claim:
    """Start a new attempt (the previous one becomes stale). With an `Idempotency-Key` header, the same request
    again returns the attempt the first one started (with a new gateway key; the one the earlier answer carried
    is revoked) instead of starting another."""
    arrived = None if idempotency_key is None else context.store.clock()
    started = await context.store.start_attempt(rollout_id, body.worker_id, idempotency_key)
    return await to_claim(context, request, started, arrived=arrived)


@router.patch("/rollouts/{rollout_id}/attempts/{attempt_id}", response_model=Attempt)
async def update_attempt(
    rollout_id: str,
    attempt_id: str,
    body: AttemptUpdate,
    context: Context,
    idempotency_key: IdempotencyKey = None,
) -> Attempt:
    """Report an attempt's outcome (`succeeded`/`failed`) or metadata; `attempt_id` may be `latest`.

    With `reward`, the reward is recorded on the attempt as `POST .../rewards` records one, in the same
    transaction as the status: an agent's end is one request. With an `Idempotency-Key`, a retry records the
    reward once."""
    metadata: Any = body.metadata if "metadata" in body.model_fields_set else UNSET
    reward = None
    if "reward" in body.model_fields_set:
        reward = reward_span(rollout_id, body.reward, body.reward_name, idempotency_key)
    return await context.store.update_attempt(
        rollout_id, attempt_id, status=body.status, metadata=metadata, reward=reward, idempotency_key=idempotency_key
    )


@router.patch("/attempts", response_model=AttemptResults)
async def update_attempts(body: AttemptChanges, context: Context) -> AttemptResults:
    """Many attempts' updates in one request, each as its own `PATCH .../attempts/{attempt_id}` would be done
    (the Python client sends the ends its agents report at once this way). Each gets its own status and the
    attempt or the error envelope; one refused update leaves the others done. A database that is down is a
    503 for the whole request."""

    async def one(change: AttemptChange) -> AttemptResult:
        metadata: Any = change.metadata if "metadata" in change.model_fields_set else UNSET
        reward = None
        if "reward" in change.model_fields_set:
            reward = reward_span(change.rollout_id, change.reward, change.reward_name, change.idempotency_key)
        try:
            attempt = await context.store.update_attempt(
                change.rollout_id,
                change.attempt_id,
                status=change.status,
                metadata=metadata,
                reward=reward,
                idempotency_key=change.idempotency_key,
            )
        except UnavailableError:
            raise
        except StoreError as exc:
            status, type_ = store_error_status(exc)
            return AttemptResult(status=status, error=envelope(exc.message, type_))
        return AttemptResult(status=200, attempt=attempt)

    # Submitted together, the store's writer commits them together (SQLite: one transaction, a savepoint each).
    return AttemptResults(results=list(await asyncio.gather(*(one(change) for change in body.updates))))


@router.post("/rollouts/{rollout_id}/attempts/{attempt_id}/heartbeat", response_model=Attempt)
async def heartbeat(rollout_id: str, attempt_id: str, context: Context) -> Attempt:
    return await context.store.heartbeat(rollout_id, attempt_id)


@router.post("/rollouts/{rollout_id}/rewards", status_code=201, response_model=Span)
async def reward(
    rollout_id: str, body: RewardRequest, context: Context, idempotency_key: IdempotencyKey = None
) -> Span:
    """Record a reward as a span on the attempt (the latest by default). `value: null` stays null.

    With an `Idempotency-Key` header, the same request again returns the reward the first one recorded
    instead of recording a second (which would go to an earlier LLM call); the key with another reward is a
    409."""
    span = reward_span(rollout_id, body.value, body.name, idempotency_key)
    span.attempt_id = None if body.attempt_id == "latest" else body.attempt_id
    [written] = await context.store.add_spans([span], idempotency_key, stamped=REWARD_STAMPED)
    return written


def reward_span(rollout_id: str, value: float | None, name: str, idempotency_key: str | None) -> Span:
    """A reward as the span it is stored as (on the latest attempt until the caller names one)."""
    now = time.time()
    return Span(
        rollout_id=rollout_id,
        trace_id=_new_id(idempotency_key, 0, "trace", 32),
        span_id=_new_id(idempotency_key, 0, "span", 16),
        name=REWARD_SPAN,
        start_time=now,
        end_time=now,
        attributes={"rollway.reward.name": name, "rollway.reward.value": value},
    )


@router.post("/rollouts/{rollout_id}/spans", status_code=201, response_model=SpansResponse)
async def add_spans(
    rollout_id: str, body: SpansRequest, context: Context, idempotency_key: IdempotencyKey = None
) -> SpansResponse:
    """Add spans to an attempt (`attempt_id` per span, default latest); missing sequence ids are assigned;
    spans whose `span_id` is already stored are skipped.

    With an `Idempotency-Key` header, missing span and trace ids derive from the key, and the answer holds
    every span of the request as stored: the same request again writes nothing twice."""
    spans = []
    for i, item in enumerate(body.spans):
        data = item.model_dump()
        data["rollout_id"] = rollout_id
        data["trace_id"] = item.trace_id or _new_id(idempotency_key, i, "trace", 32)
        data["span_id"] = item.span_id or _new_id(idempotency_key, i, "span", 16)
        spans.append(Span.model_validate(data))
    return SpansResponse(spans=await context.store.add_spans(spans, idempotency_key))


def _new_id(key: str | None, position: int, kind: str, digits: int) -> str:
    """A new span or trace id (hex): random, or derived from the request's idempotency key."""
    return secrets.token_hex(digits // 2) if key is None else ids.derived_hex(key, position, kind, digits=digits)


@router.get("/rollouts/{rollout_id}/spans", response_model=SpanPage)
async def get_spans(
    rollout_id: str,
    context: Context,
    attempt_id: str = "latest",
    after_sequence: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
    limit: Annotated[int | None, Query(ge=1, le=1000)] = None,
    name: Annotated[str | None, Query(min_length=1, max_length=512)] = None,
) -> SpanPage:
    """Spans in sequence order; `attempt_id` is `latest` (default), `all`, or an attempt id. For one attempt,
    `after_sequence` (the last `sequence_id` seen) and `limit` read them a page at a time; every span when
    both are absent. `name` keeps the spans of that name (`rollway.reward`: the rewards)."""
    if after_sequence is not None and attempt_id == "all":
        raise HTTPException(400, "after_sequence needs one attempt: sequence ids start again in each attempt")
    spans = await context.store.query_spans(
        rollout_id, attempt_id, name=name, after_sequence=after_sequence, limit=limit
    )
    return SpanPage(items=spans)


@router.get("/spans/unattributed", response_model=UnattributedSpanPage)
async def unattributed_spans(
    context: Context, limit: Annotated[int, Query(ge=1, le=1000)] = 100, cursor: str | None = None
) -> UnattributedSpanPage:
    """Spans of calls that named no rollout (served and recorded all the same), in arrival order; `next_cursor`
    pages on (`null` on the last page)."""
    if cursor is not None and not (cursor.isascii() and cursor.isdigit() and len(cursor) <= 18):
        raise HTTPException(400, "cursor must be a next_cursor this route returned")
    items = await context.store.query_spans(None, after_sequence=None if cursor is None else int(cursor), limit=limit)
    more = len(items) == limit and items[-1].sequence_id is not None
    return UnattributedSpanPage(items=items, next_cursor=str(items[-1].sequence_id) if more else None)


@router.get("/groups/{group_id}", response_model=GroupView)
async def group(group_id: str, context: Context) -> GroupView:
    rollouts = await context.store.get_group(group_id)
    size = max((r.group_size or 0 for r in rollouts), default=len(rollouts)) or len(rollouts)
    finished = sum(1 for r in rollouts if r.status in ("succeeded", "failed", "cancelled"))
    health = await group_health(context.store, [r for r in rollouts if r.status in COUNTED])
    return GroupView(
        group_id=group_id, size=size, finished=finished, complete=finished >= size, rollouts=rollouts, health=health
    )


async def group_health(store: Store, members: list[Rollout]) -> GroupHealth:
    """``GroupHealth`` of the finished members (one read of the spans of each one's latest attempt)."""
    answers = []
    for rollout in members:
        spans = await store.query_spans(rollout.rollout_id, "latest")
        answers.append((rollout.rollout_id, answers_of(s.attributes for s in spans)))
    return health_of(answers)
