"""Remote agent servers (the Osmosis remote-rollout protocol, docs/remote-agents.md): the registry, the claim that
hands an agent server its tasks within its concurrency limit, and the completion it reports.

A task enqueued with ``agent: <name>`` waits in a queue of its own (``store.sql.queue``: runner claims never see
it). ``claim`` locks the server's row, so processes sharing one database take turns, and hands out at most
``max_concurrent`` minus the server's live rollouts (``preparing``/``running``). ``complete`` records the
outcome in one transaction: the reward span, the completion in the attempt's metadata (``completion``), and
the attempt's status; a second report for the same attempt changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import orjson
from sqlalchemy import Connection, RowMapping, delete, func, select, update

from rollway.store.controlled import RESERVED_AGENT_PREFIX
from rollway.store.db import models
from rollway.store.db.dialect import lock_rows, serialize_key
from rollway.store.db.limits import named_nonfinite
from rollway.store.errors import ConflictError, NotFoundError, StoreValidationError, UnavailableError
from rollway.store.exports import REWARD_SPAN
from rollway.store.schemas import AgentServer, Attempt, AttemptedRollout, RemoteCompletion, Span
from rollway.store.sql import convert, queue, spans
from rollway.store.sql.catalog import Cipher, holds_credentials, read_key, stored_key
from rollway.store.sql.lifecycle import apply_attempt_status, load_attempt, load_rollout, require_latest
from rollway.store.states import ACTIVE, ATTEMPT_TERMINAL, AttemptStatus, RolloutStatus

G = models.agent_servers
R = models.rollouts
#: The attempt-metadata key holding an agent server's completion report.
COMPLETION_KEY = "completion"


def worker_id(name: str) -> str:
    """The worker id attempts dispatched to agent server ``name`` carry."""
    return f"agent:{name}"


def _server(row: RowMapping, cipher: Cipher | None) -> AgentServer:
    return AgentServer(
        name=row["name"],
        url=row["url"],
        api_key=read_key(row, cipher, f"agent server '{row['name']}'"),
        max_concurrent=row["max_concurrent"],
        completion_params=row["completion_params"],
        protocol=row["protocol"],
        created_time=row["created_time"],
        updated_time=row["updated_time"],
    )


def put(conn: Connection, server: AgentServer, now: float, cipher: Cipher | None = None) -> AgentServer:
    """Register or replace agent server ``server.name``. Puts of one name take turns (``serialize_key``, as
    ``catalog.put_model``): two at once would both find none, and the second insert be refused as a duplicate."""
    if holds_credentials(server.url):
        raise StoreValidationError(
            "agent server url must not hold credentials (user:password@host): give the key as api_key"
        )
    if not server.url.startswith(("http://", "https://")):
        raise StoreValidationError(f"agent server url must start with http:// or https://, got '{server.url}'")
    if server.name.startswith(RESERVED_AGENT_PREFIX):  # the controlled rollouts' queue (``store.controlled``)
        raise StoreValidationError(f"agent server names starting with '{RESERVED_AGENT_PREFIX}' are reserved")
    values = {
        "url": server.url.rstrip("/"),
        **stored_key(server.api_key.get_secret_value() if server.api_key else None, cipher),
        "max_concurrent": server.max_concurrent,
        "completion_params": server.completion_params,
        "protocol": server.protocol,
        "updated_time": now,
    }
    serialize_key(conn, "agent:" + server.name)
    found = conn.execute(select(G.c.name).where(G.c.name == server.name)).first()
    if found is None:
        conn.execute(G.insert().values(name=server.name, created_time=now, **values))
    else:
        conn.execute(update(G).where(G.c.name == server.name).values(**values))
    return get(conn, server.name, cipher)


def get(conn: Connection, name: str, cipher: Cipher | None = None) -> AgentServer:
    row = conn.execute(select(G).where(G.c.name == name)).mappings().first()
    if row is None:
        raise NotFoundError(f"agent server '{name}' not found")
    return _server(row, cipher)


def list_all(conn: Connection, cipher: Cipher | None = None) -> list[AgentServer]:
    return [_server(r, cipher) for r in conn.execute(select(G).order_by(G.c.name)).mappings()]


def remove(conn: Connection, name: str) -> None:
    """Unregister a server; its queued tasks stay queued until a server of that name is registered again."""
    if conn.execute(delete(G).where(G.c.name == name)).rowcount == 0:
        raise NotFoundError(f"agent server '{name}' not found")


def live(conn: Connection, name: str) -> int:
    """How many of the server's rollouts are being worked on (``preparing``/``running``)."""
    stmt = select(func.count()).where(R.c.agent == name, R.c.status.in_([s.value for s in ACTIVE]))
    return int(conn.execute(stmt).scalar_one())


def claim(conn: Connection, name: str, limit: int, now: float) -> list[AttemptedRollout]:
    """Up to ``limit`` queued tasks of agent server ``name``, never more than its free slots."""
    row = conn.execute(lock_rows(select(G).where(G.c.name == name), conn)).mappings().first()
    if row is None:
        raise NotFoundError(f"agent server '{name}' not found")
    if row["max_concurrent"] is not None:
        limit = min(limit, row["max_concurrent"] - live(conn, name))
    if limit <= 0:
        return []
    return queue.claim(conn, worker_id(name), limit, now, agent=name)


def _latest_attempts(
    conn: Connection, name: str, statuses: Iterable[RolloutStatus]
) -> Iterator[tuple[RowMapping, RowMapping]]:
    """(rollout, its latest attempt) of each rollout of agent server ``name`` in one of ``statuses``."""
    stmt = select(R).where(R.c.agent == name, R.c.status.in_([s.value for s in statuses]))
    for rollout in conn.execute(stmt).mappings().all():
        try:
            yield rollout, load_attempt(conn, rollout, "latest", lock=False)
        except NotFoundError:
            continue


def undispatched(conn: Connection, name: str, started_before: float, marked_before: float) -> list[AttemptedRollout]:
    """The attempts dispatched to server ``name`` whose init left no trace: still ``preparing``, the latest of
    their rollout, keeping no polling lease, and either no ``dispatch`` in their metadata (the dispatcher records
    every init's outcome there) and begun before ``started_before``, or an Osmosis 0.3 admission still in
    progress whose mark (``dispatch.admitting``, renewed while it waits out 429s) is older than
    ``marked_before``. The process sending their init ended (crash, restart) before it could record anything,
    and nothing else would send it again: the rollout would wait for ever (or for its timeout) and hold a slot
    of the server's ``max_concurrent``. Sending a v1 init again is safe: its idempotency key is the attempt id,
    so a server that got the first one starts nothing new. A 0.3 server that got the first admission answers the
    second 409; that run, whose lease was lost, is then cancelled there and the attempt fails, for the rollout's
    retry config to start another, unless the attempt keeps a lease by then (the process that had it accepted
    wrote it late, the database having been down): that run is left to its polls."""
    found = []
    for rollout, attempt in _latest_attempts(conn, name, [RolloutStatus.PREPARING]):
        metadata = attempt["metadata"] if isinstance(attempt["metadata"], dict) else {}
        dispatch = metadata.get("dispatch")
        mark = dispatch.get("admitting") if isinstance(dispatch, dict) else None
        if (
            attempt["status"] == AttemptStatus.PREPARING.value
            and attempt["worker_id"] == worker_id(name)
            and attempt["agent_lease"] is None
            and (
                (dispatch is None and attempt["start_time"] < started_before)
                or (isinstance(mark, int | float) and mark < marked_before)
            )
        ):
            found.append(AttemptedRollout(rollout=convert.rollout(rollout), attempt=convert.attempt(attempt)))
    return found


def record_lease(
    conn: Connection, rollout_id: str, attempt_id: str, lease: dict[str, Any] | None, cipher: Cipher | None
) -> bool:
    """Keep (or, with None, drop) an Osmosis 0.3 polling lease on the attempt: JSON, encrypted with ``cipher``
    when there is one. False when the attempt is gone."""
    rollout = load_rollout(conn, rollout_id)
    try:
        attempt = load_attempt(conn, rollout, attempt_id)
    except NotFoundError:
        return False
    stored = None
    if lease is not None:
        plain = orjson.dumps(lease).decode()
        stored = cipher.seal(plain) if cipher is not None else plain
    A = models.attempts
    conn.execute(update(A).where(A.c.pk == attempt["pk"]).values(agent_lease=stored))
    return True


def leases(conn: Connection, name: str, cipher: Cipher | None) -> list[tuple[AttemptedRollout, dict[str, Any]]]:
    """The live attempts of agent server ``name`` that keep a polling lease, each with it: the latest attempt of
    a live rollout, not ended. A lease this process cannot decrypt (another secret key) is left out."""
    found = []
    for rollout, attempt in _latest_attempts(conn, name, ACTIVE):
        stored = attempt["agent_lease"]
        if stored is None or AttemptStatus(attempt["status"]) in ATTEMPT_TERMINAL:
            continue
        try:
            plain = stored if stored.startswith("{") or cipher is None else cipher.open(stored, "a polling lease")
            lease = orjson.loads(plain)
        except (UnavailableError, orjson.JSONDecodeError):
            continue
        found.append((AttemptedRollout(rollout=convert.rollout(rollout), attempt=convert.attempt(attempt)), lease))
    return found


def reward_span(rollout_id: str, attempt_id: str | None, value: float, now: float, **extra: Any) -> Span:
    """A primary reward of ``value`` as a span of the attempt (the latest when None), with ``extra`` attributes."""
    return spans.point_span(
        rollout_id,
        attempt_id,
        REWARD_SPAN,
        {"rollway.reward.name": "primary", "rollway.reward.value": value} | extra,
        now,
    )


def complete(conn: Connection, report: RemoteCompletion, attempt_id: str | None, now: float) -> tuple[Attempt, bool]:
    """Record an agent server's completion for the attempt (the latest when ``attempt_id`` is None):
    (the attempt, whether this report was a duplicate that changed nothing).

    ``COMPLETED`` → the attempt succeeds, ``ERROR`` → it fails (and the rollout retries per its config). The
    reward (when not null) is a ``rollway.reward`` span written before the status, so it is the attempt's
    last span and goes to its last LLM call. A report for an attempt that already ended otherwise (the
    watchdog timed it out, a newer attempt replaced it) is a conflict.
    """
    rollout = load_rollout(conn, report.rollout_id)
    attempt = load_attempt(conn, rollout, attempt_id or "latest")
    if isinstance(attempt["metadata"], dict) and attempt["metadata"].get(COMPLETION_KEY) is not None:
        return convert.attempt(attempt), True
    require_latest(rollout, attempt)
    if attempt["status"] in ATTEMPT_TERMINAL:
        raise ConflictError(
            f"attempt '{attempt['attempt_id']}' of rollout '{report.rollout_id}' already ended "
            f"({AttemptStatus(attempt['status'])}): the completion comes too late"
        )
    if report.reward is not None:
        spans.add(conn, [reward_span(report.rollout_id, attempt["attempt_id"], report.reward, now)], now)
        rollout = load_rollout(conn, report.rollout_id)
        attempt = load_attempt(conn, rollout, attempt["attempt_id"])
    completion: dict[str, Any] = {
        "status": report.status,
        "finish_reason": report.finish_reason,
        "error_message": report.error_message,
        "reward": report.reward,
        "metrics": named_nonfinite(report.metrics),  # a NaN loss stays "NaN", never null
        "final_messages": named_nonfinite(report.final_messages),
        "extra_fields": named_nonfinite(report.extra_fields) or None,
        "time": now,
    }
    metadata = dict(attempt["metadata"] or {}) | {COMPLETION_KEY: completion}
    conn.execute(update(models.attempts).where(models.attempts.c.pk == attempt["pk"]).values(metadata=metadata))
    status = AttemptStatus.SUCCEEDED if report.status == "COMPLETED" else AttemptStatus.FAILED
    apply_attempt_status(conn, rollout, attempt, status, now)
    return convert.attempt(load_attempt(conn, rollout, attempt["attempt_id"], lock=False)), False


def record_dispatch(conn: Connection, rollout_id: str, attempt_id: str, info: dict[str, Any]) -> bool:
    """Merge what the dispatcher learned (tools, tries, error) into the attempt's metadata under ``dispatch``,
    keeping whatever else is there (a completion may already have arrived). False when the attempt is gone."""
    rollout = load_rollout(conn, rollout_id)
    try:
        attempt = load_attempt(conn, rollout, attempt_id)
    except NotFoundError:
        return False
    metadata = dict(attempt["metadata"] or {})
    metadata["dispatch"] = dict(metadata.get("dispatch") or {}) | info
    conn.execute(update(models.attempts).where(models.attempts.c.pk == attempt["pk"]).values(metadata=metadata))
    return True
