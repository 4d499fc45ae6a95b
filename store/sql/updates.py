"""Weight updates (``weight_updates``): each change of an alias's weights, from its begin to its end.

``begin`` holds the alias in the transaction that records the update: it pauses the alias (new calls wait, up to
``hold_until``), names the update on the alias row (one open update per alias; another begin is a conflict) and
moves the catalog revision, so every replica holds its calls from its next call on. ``finish`` ends it in one
transaction too: a commit gives the alias the new version (and clears the per-backend versions: every engine
behind it now serves the new weights); a failed reload gives the backends that did take the new weights that
version as their own (``relabel``); any end releases the hold and leaves the alias paused or running as the
update's ``was_paused`` says: the pause it had at the begin, which Agent-lightning 1.0's proxy pause changes while
the update is open (``store.sql.controlled``).
Only an update still ``open`` can end, so an expiry racing a commit leaves exactly one of them.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from sqlalchemy import Connection, select, update

from rollway.store import ids
from rollway.store.db import models
from rollway.store.db.dialect import serialize_key
from rollway.store.errors import ConflictError, NotFoundError
from rollway.store.schemas import EngineStep, InFlightPolicy, UpdateForm, UpdateState, WeightUpdate
from rollway.store.sql import catalog

U = models.weight_updates
M = models.model_aliases


def _update(row: Any) -> WeightUpdate:
    return WeightUpdate(
        update_id=row["update_id"],
        alias=row["alias"],
        state=row["state"],
        form=row["form"],
        in_flight=row["in_flight"],
        from_version=row["from_version"],
        to_version=row["to_version"],
        by=row["by"],
        note=row["note"],
        begun_time=row["begun_time"],
        deadline=row["deadline"],
        finished_time=row["finished_time"],
        held_seconds=row["held_seconds"],
        drained=row["drained"],
        aborted_calls=row["aborted_calls"],
        steps=[EngineStep.model_validate(s) for s in row["steps"] or []],
        engine_versions=row["engine_versions"] or {},
        error=row["error"],
    )


def get(conn: Connection, update_id: str) -> WeightUpdate:
    row = conn.execute(select(U).where(U.c.update_id == update_id)).mappings().first()
    if row is None:
        raise NotFoundError(f"weight update '{update_id}' not found")
    return _update(row)


def page(conn: Connection, alias: str | None, limit: int) -> list[WeightUpdate]:
    """The latest ``limit`` updates (of ``alias``, when given), newest first."""
    query = select(U).order_by(U.c.begun_time.desc(), U.c.update_id.desc()).limit(limit)
    if alias is not None:
        query = query.where(U.c.alias == alias)
    return [_update(row) for row in conn.execute(query).mappings()]


def open_updates(conn: Connection) -> list[WeightUpdate]:
    return [_update(row) for row in conn.execute(select(U).where(U.c.state == "open")).mappings()]


def begin(
    conn: Connection,
    alias: str,
    *,
    to_version: str | None,
    form: UpdateForm,
    in_flight: InFlightPolicy,
    by: str,
    note: str | None,
    now: float,
    deadline: float,
) -> WeightUpdate:
    """Record an open update of ``alias`` and hold the alias for it (see the module docstring). ``to_version``
    None: the alias's version + 1."""
    serialize_key(conn, "model:" + alias)  # the same turn a put of the alias takes
    row = conn.execute(select(M).where(M.c.alias == alias)).mappings().first()
    if row is None:
        raise NotFoundError(f"model '{alias}' not found")
    if row["update_id"] is not None:
        raise ConflictError(f"model '{alias}' has weight update '{row['update_id']}' open: commit or abort it first")
    target = to_version if to_version is not None else catalog.next_version(row["version"])
    if target == row["version"]:
        raise ConflictError(f"model '{alias}' is at version '{target}' already: give the version the new weights are")
    update_id = ids.update_id()
    conn.execute(
        U.insert().values(
            update_id=update_id,
            alias=alias,
            state="open",
            form=form,
            in_flight=in_flight,
            from_version=row["version"],
            to_version=target,
            by=by[:256],
            note=note,
            was_paused=bool(row["paused"]),
            begun_time=now,
            deadline=deadline,
            aborted_calls=0,
            steps=[],
            engine_versions={},
        )
    )
    conn.execute(
        update(M)
        .where(M.c.alias == alias)
        .values(paused=True, update_id=update_id, hold_until=deadline, updated_time=now)
    )
    catalog.bump_revision(conn)
    return get(conn, update_id)


def record(conn: Connection, update_id: str, **values: Any) -> WeightUpdate:
    """Note what an open update did so far (``drained``, ``steps``, ``engine_versions``); a
    new ``deadline`` moves the alias's hold with it."""
    values = _jsonable(values)
    conn.execute(update(U).where(U.c.update_id == update_id, U.c.state == "open").values(**values))
    if "deadline" in values:
        conn.execute(update(M).where(M.c.update_id == update_id).values(hold_until=values["deadline"]))
    return get(conn, update_id)


def count_aborted(conn: Connection, update_id: str, calls: int) -> None:
    """Add ``calls`` to an open update's aborted calls: each replica counts the calls it ended for it."""
    stmt = update(U).where(U.c.update_id == update_id, U.c.state == "open")
    conn.execute(stmt.values(aborted_calls=U.c.aborted_calls + calls))


def finish(
    conn: Connection,
    update_id: str,
    state: UpdateState,
    now: float,
    *,
    error: str | None = None,
    relabel: Collection[str] = (),
    **values: Any,
) -> WeightUpdate:
    """End an open update as ``state`` (``committed``, ``failed``, ``aborted`` or ``expired``): the alias gets
    the new version on a commit, and its hold is released whatever the end. The backends in ``relabel`` (those
    that took the new weights in an update that failed elsewhere) get the new version as their own, so their
    calls are recorded under the weights they serve. A ``ConflictError`` when the update has ended already (it
    says how)."""
    found = get(conn, update_id)
    serialize_key(conn, "model:" + found.alias)
    row = conn.execute(select(U).where(U.c.update_id == update_id)).mappings().first()
    assert row is not None
    if row["state"] != "open":
        raise ConflictError(
            f"weight update '{update_id}' has ended already ({row['state']}"
            + (f": {row['error']}" if row["error"] else "")
            + ")"
        )
    values = _jsonable(values)
    values.update(state=state, finished_time=now, held_seconds=now - row["begun_time"], error=error)
    conn.execute(update(U).where(U.c.update_id == update_id).values(**values))
    alias = conn.execute(select(M).where(M.c.alias == found.alias)).mappings().first()
    if alias is not None and alias["update_id"] == update_id:
        released: dict[str, Any] = {
            "paused": bool(row["was_paused"]),
            "update_id": None,
            "hold_until": None,
            "updated_time": now,
        }
        if state == "committed":
            released["version"] = row["to_version"]
            released["backends"] = [{**b, "version": None} for b in alias["backends"]]
        elif relabel:
            released["backends"] = [
                {**b, "version": row["to_version"]} if b["backend_id"] in relabel else b for b in alias["backends"]
            ]
        conn.execute(update(M).where(M.c.alias == found.alias).values(**released))
        catalog.bump_revision(conn)
    return get(conn, update_id)


def _jsonable(values: dict[str, Any]) -> dict[str, Any]:
    out = dict(values)
    if "steps" in out:
        out["steps"] = [s.model_dump() if isinstance(s, EngineStep) else s for s in out["steps"]]
    return out
