"""Keyed requests sent again: what an enqueue, claim, direct start or new attempt carrying a client's
idempotency key gets when its key was used before (see ``store.sql.enqueue``; spans: ``keyed_spans.add_keyed``).

A first try leaves no record of its request apart from the rows it wrote — all in one transaction, with ids
derived from the key and their place in the request (``ids.derived``) — and a digest of what it asked for,
kept on each of those rows (``request_digest``, migration 0005: no key table, nothing to prune; it goes with
its row). A request sent again is recognised by those rows: every row it stands for must exist, no row it does
not stand for may exist (a task more or fewer), and the digest must be its own. The rows' columns are not what
is compared, because they change after the first try without the request changing: ``update_rollout`` edits
a rollout's input, metadata, config ..., ``update_attempt`` an attempt's worker; a retry after such an edit is
still the same request, and gets the rows as they are now, while a request that asks for what the rows hold
now is another request. Rows written before migration 0005 keep no digest and are compared by their columns,
as before (an edit since then makes a retry a conflict).

What a digest covers: an enqueue, all its tasks (those naming their own ``rollout_id`` too, in their places);
a direct start, its task and worker; a new attempt, its rollout and worker; a claim, its worker (its
``limit`` is only seen through what it took). Fields are taken as the task gives them, with the defaults the
store fills in made explicit (``config``), so leaving out a default and spelling it out are one request (and
a task joining a named group is not judged by the size and index the group gave its rollouts then). What
cannot be recognised: a first request that made nothing with a derived id (tasks that all name their own
``rollout_id``, a claim that found the queue empty). The request sent again with another body is the client's
mistake, not a retry: a ``ConflictError``, and nothing is returned as if it were the first answer.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import orjson
from sqlalchemy import Connection, RowMapping, bindparam, select

from rollway.store import ids
from rollway.store.db import models
from rollway.store.db.dialect import prebuilt
from rollway.store.db.engine import dumps, loads
from rollway.store.errors import ConflictError
from rollway.store.schemas import AttemptedRollout, RolloutConfig, TaskSpec
from rollway.store.sql import convert
from rollway.store.sql import resources as resources_ops
from rollway.store.sql.lifecycle import load_rollout
from rollway.store.states import ATTEMPT_TERMINAL

R = models.rollouts
A = models.attempts


def other_request(key: str) -> ConflictError:
    return ConflictError(f"idempotency key '{key}' was already used for a different request")


def digest(*request: Any) -> str:
    """The digest a keyed request leaves on the rows it makes: of its JSON, keys sorted (32 hex digits)."""
    try:
        text = orjson.dumps(request, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # what orjson refuses (integers beyond 64 bits ...), as ``engine.dumps`` does
        text = json.dumps(request, sort_keys=True).encode()
    return hashlib.sha256(text).hexdigest()[:32]


def _task(spec: TaskSpec) -> dict[str, Any]:
    """A task as a digest sees it: the fields it sets, with the default ``config`` spelled out (a field added to
    ``TaskSpec`` later leaves the digests of the tasks that do not set it as they were)."""
    explicit = spec.model_copy(update={"config": spec.config or RolloutConfig()})
    return explicit.model_dump(mode="json", exclude_defaults=True)


def enqueue_digest(specs: list[TaskSpec]) -> str:
    return digest("enqueue", [_task(spec) for spec in specs])


def start_digest(spec: TaskSpec, worker_id: str | None) -> str:
    return digest("start", _task(spec), worker_id)


def attempt_digest(rollout_id: str, worker_id: str | None) -> str:
    return digest("attempt", rollout_id, worker_id)


def claim_digest(worker_id: str | None) -> str:
    return digest("claim", worker_id)


def _made_by(stored: RowMapping, request: str, *, same_columns: bool) -> bool:
    """Whether ``stored`` was made by the request whose digest is ``request``. A row written before migration
    0005 keeps no digest: ``same_columns`` (it holds what the request asks for) decides, as it did then."""
    if stored["request_digest"] is None:
        return same_columns
    return bool(stored["request_digest"] == request)


#: The rollout columns a task sets (``enqueue.rollout_row``), compared when a row written before migration 0005 is sent
#: again with its key.
_TASK_COLUMNS = ("input", "mode", "config", "metadata", "group_id", "group_size", "group_index", "priority", "agent")


#: Without them: a task that names a group joins it, and its place depends on the members the group had then.
_JOINING_COLUMNS = tuple(c for c in _TASK_COLUMNS if c not in ("group_size", "group_index"))


def same_task(row: dict[str, Any], spec: TaskSpec, stored: RowMapping) -> bool:
    """Whether ``stored`` is the rollout that ``spec``, planned as ``row``, would have made: every column the
    task sets, as JSON stores it; ``resources_id`` only when the task names one (else it was the latest then);
    a named group's size and index only as the group had them (``groups.join``), so not compared."""
    if spec.resources_id is not None and stored["resources_id"] != spec.resources_id:
        return False
    columns = _JOINING_COLUMNS if spec.group_id else _TASK_COLUMNS
    return all(loads(dumps(row[c])) == stored[c] for c in columns)


def enqueued_before(
    conn: Connection,
    key: str,
    request: str,
    specs: list[TaskSpec],
    planned: list[dict[str, Any]],
    keyed: list[tuple[dict[str, Any], TaskSpec]],
) -> list[RowMapping] | None:
    """The rollouts the first enqueue with ``key`` queued, as they are now, when this is that request again
    (digest ``request``; rows ``planned``, of which ``keyed`` have ids derived from the key); None when the key
    is new.

    The request again finds every rollout it stands for (one more task, or a larger group, would be a new one)
    and no keyed rollout at the place after its last task or at a place where it names its own ``rollout_id``
    (the first request had one more task, or another one, there); each keyed rollout was made by it."""
    foreign = [ids.derived("ro-", key, p, 0) for p, spec in enumerate(specs) if spec.rollout_id]
    foreign.append(ids.derived("ro-", key, len(specs), 0))
    wanted = [r["rollout_id"] for r in planned] + foreign
    stored = {r["rollout_id"]: r for r in conn.execute(select(R).where(R.c.rollout_id.in_(wanted))).mappings()}
    if not any(row["rollout_id"] in stored for row, _ in keyed) and not any(f in stored for f in foreign):
        return None  # the key's first request (or one that failed, and wrote nothing)
    if any(f in stored for f in foreign) or any(r["rollout_id"] not in stored for r in planned):
        raise other_request(key)
    for row, spec in keyed:
        made = stored[row["rollout_id"]]
        if not _made_by(made, request, same_columns=same_task(row, spec, made)):
            raise other_request(key)
    return [stored[r["rollout_id"]] for r in planned]


def _build_attempt_exists(conn: Connection) -> Any:
    return select(A.c.pk).where(A.c.attempt_id == bindparam("aid"))


def claimed_before(conn: Connection, key: str, worker_id: str | None, limit: int) -> list[AttemptedRollout]:
    """What an earlier claim with ``key`` handed out (its attempts' ids derive from the key and their place),
    as the rollouts and attempts are now; empty when there was none. Another worker's key, or a claim that took
    more than ``limit`` (the first one asked for more), is a conflict, and so is a claim whose attempt is over."""
    first = ids.derived("at-", key, 0)  # a claim that handed out anything made this attempt
    if conn.execute(prebuilt(conn, "attempt_exists", _build_attempt_exists), {"aid": first}).first() is None:
        return []
    wanted = [first, *(ids.derived("at-", key, i) for i in range(1, limit + 1))]  # + 1: the first took more?
    attempts = conn.execute(select(A).where(A.c.attempt_id.in_(wanted))).mappings().all()
    request = claim_digest(worker_id)
    if not all(_made_by(a, request, same_columns=a["worker_id"] == worker_id) for a in attempts):
        raise ConflictError(f"idempotency key '{key}' was already used by another worker's claim")
    if any(a["attempt_id"] == wanted[limit] for a in attempts):
        raise other_request(key)
    place = {attempt_id: i for i, attempt_id in enumerate(wanted)}
    attempts = sorted(attempts, key=lambda a: place[a["attempt_id"]])
    rollout_ids = [a["rollout_id"] for a in attempts]
    rollouts = {r["rollout_id"]: r for r in conn.execute(select(R).where(R.c.rollout_id.in_(rollout_ids))).mappings()}
    for a in attempts:  # a retry long after the claim: its attempt may be over, and must not be run again
        if a["status"] in ATTEMPT_TERMINAL or rollouts[a["rollout_id"]]["latest_attempt_id"] != a["attempt_id"]:
            raise ConflictError(f"the claim made with idempotency key '{key}' is over (attempt {a['attempt_id']})")
    return as_they_are(conn, [(rollouts[a["rollout_id"]], a) for a in attempts])


def started_before(
    conn: Connection, key: str, rollout: RowMapping, row: dict[str, Any], spec: TaskSpec, worker_id: str | None
) -> AttemptedRollout:
    """The rollout a direct start with ``key`` made (``rollout``, stored; ``row``, as this request plans it,
    with its digest) and its first attempt, as they are now, when this request is the first one again."""
    first = conn.execute(select(A).where(A.c.rollout_id == rollout["rollout_id"], A.c.sequence_id == 1))
    attempt = first.mappings().one()
    same_columns = attempt["worker_id"] == worker_id and same_task(row, spec, rollout)
    if not _made_by(rollout, row["request_digest"], same_columns=same_columns):
        raise other_request(key)
    return as_they_are(conn, [(rollout, attempt)])[0]


def attempt_started_before(
    conn: Connection, key: str, attempt_id: str, rollout_id: str, worker_id: str | None
) -> AttemptedRollout | None:
    """The attempt a new-attempt request with ``key`` started (id ``attempt_id``, derived from the key), as it
    is now; None when there is none yet. It must still be its rollout's live attempt: a second one would have
    made it stale, and one replaced or ended since is not run again."""
    made = conn.execute(select(A).where(A.c.attempt_id == attempt_id)).mappings().first()
    if made is None:
        return None
    request = attempt_digest(rollout_id, worker_id)
    if made["rollout_id"] != rollout_id or not _made_by(made, request, same_columns=made["worker_id"] == worker_id):
        raise other_request(key)
    rollout = load_rollout(conn, rollout_id)
    if made["status"] in ATTEMPT_TERMINAL or rollout["latest_attempt_id"] != attempt_id:
        raise ConflictError(f"the attempt started with idempotency key '{key}' is over ({attempt_id})")
    return as_they_are(conn, [(rollout, made)])[0]


def as_they_are(conn: Connection, pairs: list[tuple[RowMapping, RowMapping]]) -> list[AttemptedRollout]:
    """Stored rollouts with one attempt each, as they are now (a keyed request sent again gets these)."""
    found = resources_ops.many(conn, {r["resources_id"] for r, _ in pairs if r["resources_id"]})
    return [
        AttemptedRollout(
            rollout=convert.rollout(rollout),
            attempt=convert.attempt(attempt),
            resources=found.get(rollout["resources_id"] or ""),
        )
        for rollout, attempt in pairs
    ]
