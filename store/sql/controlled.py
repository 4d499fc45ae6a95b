"""Rollouts an outside controller drives (``store.controlled``): creation, the controller's changes applied to
Rollway's rollouts and attempts in one transaction each, the log of the order they ended, their events, and the
models and the pause of the proxy their agents call through.

- A rollout is a Rollway rollout (``agent = CONTROLLER_AGENT``, one attempt, no watchdog timeout: the controller
  enforces its own) plus a ``controlled_rollouts`` row with what the controller set and a version that moves on
  every change.
- ``queuing → running`` starts the rollout's attempt; ``running → succeeded | failed`` ends it;
  ``queuing → failed`` starts and fails it. The first terminal transition, whoever makes it (a PATCH, a cancel
  through the admin API), gives the rollout its place in the terminal log (``terminal_seq``, from 1 without gaps:
  a counter moved in the same transaction). A reward written later leaves that place as it is.
- A delete hides the rollout from the controller's API; the Rollway rollout and its spans stay.
- An event becomes a span of the rollout's attempt, labelled with the controller's attempt id; a ``reward`` event
  with a number is a Rollway reward span. Events posted before the rollout started wait in the row
  (``early_events``) and are shown first.
"""

from __future__ import annotations

import contextlib
import math
import uuid
from typing import Any

from sqlalchemy import Connection, RowMapping, delete, func, select, update

from rollway.store.controlled import (
    ATTEMPT_ATTR,
    CONTROLLER_AGENT,
    DATA_ATTR,
    STATUSES_OF,
    TERMINAL,
    TRANSITIONS,
    TYPE_ATTR,
    ControlledCreate,
    ControlledPatch,
    ControlledRollout,
    EngineModel,
    ProxyPause,
    View,
    alias_for,
    backends_of,
)
from rollway.store.db import models
from rollway.store.db.dialect import serialize_key, upsert
from rollway.store.errors import ConflictError, NotFoundError
from rollway.store.schemas import RolloutConfig, TaskSpec
from rollway.store.sql import agents, catalog, convert, enqueue, queue, spans
from rollway.store.sql.lifecycle import apply_attempt_status, bump_counter, load_attempt, load_rollout
from rollway.store.states import AttemptStatus

C = models.controlled_rollouts
R = models.rollouts
M = models.engine_models
P = models.proxy_pause
A = models.model_aliases
U = models.weight_updates
TERMINAL_COUNTER = "controlled_terminal"
PAUSE_ROW = "proxy"
PAUSE_TURN = "proxy-pause"
WORKER = "agl-controller"
EVENT_SPAN = "agl.event"


def _record(row: RowMapping) -> ControlledRollout:
    return ControlledRollout(
        rollout=convert.rollout(row),
        is_train=row["is_train"],
        config=row["c_config"] or {},
        version=row["version"],
        k8s_job_name=row["k8s_job_name"],
        last_attempt_id=row["last_attempt_id"],
        error_message=row["error_message"],
        created_time=row["created_time"],
        updated_time=row["c_updated_time"],
        early_events=row["early_events"] or [],
    )


def _joined() -> Any:
    return select(
        R,
        C.c.is_train,
        C.c.config.label("c_config"),
        C.c.version,
        C.c.k8s_job_name,
        C.c.last_attempt_id,
        C.c.error_message,
        C.c.early_events,
        C.c.created_time,
        C.c.updated_time.label("c_updated_time"),
        C.c.terminal_seq,
    ).join(C, C.c.rollout_id == R.c.rollout_id)


def _find(conn: Connection, rollout_id: str) -> ControlledRollout | None:
    stmt = _joined().where(R.c.rollout_id == rollout_id, C.c.deleted_time.is_(None))
    row = conn.execute(stmt).mappings().first()
    return None if row is None else _record(row)


def get(conn: Connection, rollout_id: str) -> ControlledRollout:
    found = _find(conn, rollout_id)
    if found is None:
        raise NotFoundError(f"Rollout not found: {rollout_id}")
    return found


def live(conn: Connection, rollout_id: str) -> bool:
    """Whether ``rollout_id`` is a controlled rollout that is not deleted (what the proxy serves)."""
    stmt = select(C.c.rollout_id).where(C.c.rollout_id == rollout_id, C.c.deleted_time.is_(None))
    return conn.execute(stmt).first() is not None


def create(conn: Connection, items: list[ControlledCreate], now: float) -> list[ControlledRollout]:
    """Create each rollout, in order; an id that exists returns the stored rollout unchanged (whatever its state).
    An id taken by a rollout the controller did not create, or by one deleted, is a conflict."""
    out: list[ControlledRollout] = []
    for item in items:
        rollout_id = item.rollout_id or uuid.uuid4().hex
        if item.rollout_id is not None:
            taken = conn.execute(select(C.c.deleted_time).where(C.c.rollout_id == rollout_id)).first()
            if taken is not None:
                if taken[0] is not None:
                    raise ConflictError(f"rollout '{rollout_id}' was deleted: create it under a new id")
                out.append(get(conn, rollout_id))
                continue
            if conn.execute(select(R.c.pk).where(R.c.rollout_id == rollout_id)).first() is not None:
                raise ConflictError(f"rollout '{rollout_id}' exists and was not created through /api/rollouts")
        spec = TaskSpec(
            rollout_id=rollout_id,
            input=item.input,
            mode="train" if item.is_train else "val",
            config=RolloutConfig(max_attempts=1),
            metadata=item.metadata,
            agent=CONTROLLER_AGENT,
        )
        enqueue.enqueue(conn, [spec], now)
        row = {
            "rollout_id": rollout_id,
            "is_train": item.is_train,
            "config": item.config,
            "version": 1,
            "early_events": [],
            "created_time": now,
            "updated_time": now,
        }
        conn.execute(C.insert().values(**row))
        out.append(get(conn, rollout_id))
    return out


def listing(conn: Connection, views: set[View], limit: int) -> list[ControlledRollout]:
    """The rollouts in one of ``views``, oldest first, the first ``limit``."""
    statuses = [s.value for view in views for s in STATUSES_OF[view]]
    stmt = _joined().where(C.c.deleted_time.is_(None), R.c.status.in_(statuses)).order_by(R.c.pk).limit(max(limit, 0))
    return [_record(row) for row in conn.execute(stmt).mappings()]


def ended(conn: Connection, rollout_id: str) -> None:
    """Give a controlled rollout that just ended its place in the terminal log (once; no-op for others)."""
    stmt = select(C.c.terminal_seq).where(C.c.rollout_id == rollout_id)
    row = conn.execute(stmt).first()
    if row is None or row[0] is not None:
        return
    seq = bump_counter(conn, TERMINAL_COUNTER)
    conn.execute(update(C).where(C.c.rollout_id == rollout_id).values(terminal_seq=seq))


def locked(conn: Connection, rollout_id: str) -> ControlledRollout:
    """The rollout as ``get`` reads it, its row locked first (``FOR UPDATE`` on PostgreSQL; SQLite's single writer
    already serialises), and first of all the rows a write locks, as ``store.sql.lifecycle`` orders them: a write
    that reads and then changes it waits for any other doing the same, and cannot deadlock with one."""
    with contextlib.suppress(NotFoundError):  # (an unknown rollout: ``get`` says so, in its own words)
        load_rollout(conn, rollout_id)
    return get(conn, rollout_id)


def patch(conn: Connection, rollout_id: str, change: ControlledPatch, now: float) -> ControlledRollout:
    """Apply a controller's change (``change.model_fields_set``); an empty one changes nothing. The rollout is read
    locked (``locked``): two changes at once are checked against the transition table one after the other."""
    current = locked(conn, rollout_id)
    named = change.model_fields_set
    if not named:
        return current
    if "state" in named:
        target = change.state
        if target is None or target not in TRANSITIONS[current.state]:
            raise ConflictError(f"Rollout {rollout_id}: cannot transition {current.state} -> {target}")
        _move(conn, rollout_id, current.state, target, now)
        if target in TERMINAL:
            ended(conn, rollout_id)
    values: dict[str, Any] = {name: getattr(change, name) for name in named if name != "state"}
    values |= {"version": C.c.version + 1, "updated_time": now}
    conn.execute(update(C).where(C.c.rollout_id == rollout_id).values(**values))
    return get(conn, rollout_id)


def _move(conn: Connection, rollout_id: str, current: View, target: View, now: float) -> None:
    """The Rollway side of a view transition: start the attempt, end it, or both."""
    if current == "queuing":
        queue.start_attempt(conn, rollout_id, WORKER, now)
        if target == "running":
            return
    rollout = load_rollout(conn, rollout_id)
    attempt = load_attempt(conn, rollout, "latest")
    status = AttemptStatus.SUCCEEDED if target == "succeeded" else AttemptStatus.FAILED
    apply_attempt_status(conn, rollout, attempt, status, now)


def remove(conn: Connection, rollout_id: str, now: float) -> None:
    """Hide a rollout from the controller's API (a rollout unknown or hidden already: nothing)."""
    stmt = update(C).where(C.c.rollout_id == rollout_id, C.c.deleted_time.is_(None)).values(deleted_time=now)
    conn.execute(stmt)


def terminal(conn: Connection, after: int, limit: int) -> tuple[list[ControlledRollout], int, int]:
    """Positions ``after`` … ``after + limit - 1`` of the terminal log: (the rollouts there that are not deleted,
    the next position, the log's length)."""
    total = int(conn.execute(select(func.count()).where(C.c.terminal_seq.is_not(None))).scalar_one())
    if after >= total:  # past the log's end (``after + limit`` could also overflow the database's integers)
        return [], after, total
    stmt = (
        _joined()
        .where(C.c.terminal_seq > after, C.c.terminal_seq <= after + limit, C.c.deleted_time.is_(None))
        .order_by(C.c.terminal_seq)
    )
    items = [_record(row) for row in conn.execute(stmt).mappings()]
    return items, after + max(0, min(limit, total - after)), total


def add_event(
    conn: Connection, rollout_id: str, attempt_label: str, event_type: str, data: dict[str, Any], now: float
) -> None:
    """Keep one posted event: a span of the rollout's attempt, or an early event while it has none. The rollout is
    read locked (``locked``): early events posted at once each extend the list the one before wrote, and none is
    lost."""
    current = locked(conn, rollout_id)
    event = {"event_type": event_type, "attempt_id": attempt_label, "timestamp": now, "data": data}
    if current.rollout.attempt_count == 0:
        early = [*current.early_events, event]
        conn.execute(update(C).where(C.c.rollout_id == rollout_id).values(early_events=early))
        return
    attributes: dict[str, Any] = {ATTEMPT_ATTR: attempt_label, TYPE_ATTR: event_type, DATA_ATTR: data}
    if event_type == "reward" and (reward := _finite(data.get("value"))) is not None:
        span = agents.reward_span(rollout_id, None, reward, now, **attributes)
    else:
        span = spans.point_span(rollout_id, None, EVENT_SPAN, attributes, now)
    spans.add(conn, [span], now)


def _finite(value: Any) -> float | None:
    """``value`` as a reward: a finite number (not a bool), else None."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


# -- the proxy's models and pause --------------------------------------------------------------------------------


def put_models(conn: Connection, given: list[EngineModel], now: float) -> list[str]:
    """Upsert endpoints by (model, endpoint). The alias each model name becomes (``backends_of``) is checked
    first, with every endpoint it will have: an endpoint no alias could hold is refused, and nothing is written.
    While the proxy is paused, the aliases of the models given are held by the pause (``hold``): those it paused."""
    state = locked_pause(conn)
    merged = {(m.model, m.endpoint): m for m in [*engine_models(conn), *given]}
    names = sorted({m.model for m in given})
    for name in names:
        catalog.check_model(alias_for(name), backends_of(name, list(merged.values())))
    for model in given:
        stmt = upsert(conn, M).values(
            model=model.model, endpoint=model.endpoint, version=model.version, created_time=now
        )
        conn.execute(stmt.on_conflict_do_update(index_elements=["model", "endpoint"], set_={"version": model.version}))
    return hold(conn, [alias_for(name) for name in names], now) if state.paused else []


def delete_models(conn: Connection) -> None:
    conn.execute(delete(M))


def engine_models(conn: Connection) -> list[EngineModel]:
    rows = conn.execute(select(M).order_by(M.c.model, M.c.endpoint)).mappings()
    return [EngineModel(model=r["model"], endpoint=r["endpoint"], version=r["version"]) for r in rows]


# The pause holds model aliases so that a call reaching a replica that has not seen the pause yet waits. Which
# ones it holds (``ProxyPause.aliases``) are registered models' aliases (an alias of no registered model is an
# admin's, never the pause's), those it paused itself, or that a weight update was to resume and will now leave
# paused, and that nobody paused or resumed since: its resume resumes those and no other. Every write
# that reads or changes that list takes the pause's turn first (``locked_pause``), then an alias's own turn
# (``_turn_of``) before it writes the alias: two of them run one after the other, and none waits in a circle with
# a put or a weight update of the alias.


def pause(conn: Connection) -> ProxyPause:
    row = conn.execute(select(P).where(P.c.name == PAUSE_ROW)).mappings().first()
    if row is None:
        return ProxyPause()
    return ProxyPause(
        paused=row["paused"],
        retry_after_seconds=row["retry_after_seconds"],
        reason=row["reason"],
        aliases=row["aliases"] or [],
    )


def locked_pause(conn: Connection) -> ProxyPause:
    """The pause, read once this transaction has the pause's turn (``serialize_key``: PostgreSQL's advisory lock;
    SQLite's single writer already runs one transaction at a time)."""
    serialize_key(conn, PAUSE_TURN)
    return pause(conn)


def _set_pause(conn: Connection, state: ProxyPause, now: float) -> None:
    values = state.model_dump() | {"updated_time": now}
    stmt = upsert(conn, P).values(name=PAUSE_ROW, **values)
    conn.execute(stmt.on_conflict_do_update(index_elements=["name"], set_=values))


def pause_proxy(conn: Connection, retry_after_seconds: int, reason: str | None, now: float) -> list[str]:
    """Pause the proxy, and with it the registered models' aliases (``hold``); asked again while paused, the pause
    keeps the aliases it holds (the trainer's client sends it again after any failure). The aliases it paused."""
    before = locked_pause(conn)
    held = before.aliases if before.paused else []
    state = ProxyPause(paused=True, retry_after_seconds=retry_after_seconds, reason=reason, aliases=held)
    _set_pause(conn, state, now)
    catalog.bump_revision(conn)  # other replicas forget the pause they cached
    return hold(conn, sorted({alias_for(m.model) for m in engine_models(conn)}), now)


def hold(conn: Connection, aliases: list[str], now: float) -> list[str]:
    """Make each of ``aliases`` one the paused proxy holds, with the pause's turn taken: one running is paused (one
    the pause held before it was deleted and made again too); one a weight update holds that was running when the
    update began is left paused by the update's end; one paused otherwise is someone else's (an admin's) and is
    left as it is, and so is one that does not exist. The aliases paused."""
    state = pause(conn)
    taken: list[str] = []
    paused: list[str] = []
    for alias in dict.fromkeys(aliases):
        _turn_of(conn, alias)
        stmt = update(A).where(A.c.alias == alias, A.c.paused.is_(False)).values(paused=True, updated_time=now)
        if conn.execute(stmt).rowcount:
            taken.append(alias)
            paused.append(alias)
            continue
        stmt = update(U).where(U.c.alias == alias, U.c.state == "open", U.c.was_paused.is_(False))
        if conn.execute(stmt.values(was_paused=True)).rowcount:
            taken.append(alias)
    added = [alias for alias in taken if alias not in state.aliases]
    if added:
        _set_pause(conn, state.model_copy(update={"aliases": [*state.aliases, *added]}), now)
    if paused:
        catalog.bump_revision(conn)
    return paused


def _turn_of(conn: Connection, alias: str) -> None:
    """Take the turn a put of ``alias`` and its weight updates take (``catalog.put_model``, ``updates.begin`` and
    ``updates.finish``): an update's end reads which pause it restores only after a pause or resume of the proxy
    that changes it has committed."""
    serialize_key(conn, "model:" + alias)


def holds_new(conn: Connection, alias: str) -> bool:
    """Whether the proxy's pause is to hold ``alias`` once it is put: the proxy is paused, ``alias`` is a registered
    model's (the proxy's; an admin's alias of another model, a judge's say, is none of the pause's) and it does not
    exist yet, so that one created during the pause is held like those the pause paused. Takes the pause's turn."""
    if not locked_pause(conn).paused or alias not in {alias_for(m.model) for m in engine_models(conn)}:
        return False
    return conn.execute(select(A.c.alias).where(A.c.alias == alias)).first() is None


def release(conn: Connection, alias: str, now: float) -> None:
    """``alias`` is paused or resumed by someone else (an admin): it is no longer the pause's, so the proxy's resume
    leaves it as that change left it. Takes the pause's turn."""
    state = locked_pause(conn)
    if alias in state.aliases:
        kept = [a for a in state.aliases if a != alias]
        _set_pause(conn, state.model_copy(update={"aliases": kept}), now)


def resume_proxy(conn: Connection, now: float) -> list[str]:
    """End the proxy's pause and resume the aliases it holds; one a weight update holds now is resumed by the
    update's end instead. The aliases resumed."""
    before = locked_pause(conn)
    resumed: list[str] = []
    for alias in before.aliases:
        _turn_of(conn, alias)
        stmt = update(A).where(A.c.alias == alias, A.c.paused.is_(True), A.c.update_id.is_(None))
        if conn.execute(stmt.values(paused=False, updated_time=now)).rowcount:
            resumed.append(alias)
        else:
            stmt = update(U).where(U.c.alias == alias, U.c.state == "open")
            conn.execute(stmt.values(was_paused=False))
    state = ProxyPause(paused=False, retry_after_seconds=before.retry_after_seconds, reason=None, aliases=[])
    _set_pause(conn, state, now)
    catalog.bump_revision(conn)
    return resumed


def attempt_labels(conn: Connection, rollout_id: str) -> list[str]:
    """The controller's attempt ids that have events, ordered by their first event."""
    current = get(conn, rollout_id)
    S = models.spans
    label = S.c.attributes[ATTEMPT_ATTR].as_string()
    stmt = (
        select(label, func.min(S.c.start_time)).where(S.c.rollout_id == rollout_id, label.is_not(None)).group_by(label)
    )
    first: dict[str, float] = {}
    for event in current.early_events:
        first.setdefault(event["attempt_id"], event["timestamp"])
    for name, when in conn.execute(stmt):
        first[name] = min(first.get(name, when or 0.0), when or 0.0)
    return sorted(first, key=lambda name: first[name])
