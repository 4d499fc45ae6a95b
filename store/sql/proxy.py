"""The models and the pause of the proxy an outside controller's agents call through (``store.controlled``):
the registered engine models, each served by a Rollway model alias, and the pause that holds those aliases while
the controller changes the weights behind them."""

from __future__ import annotations

from sqlalchemy import Connection, delete, select, update

from rollway.store.controlled import EngineModel, ProxyPause, alias_for, backends_of
from rollway.store.db import models
from rollway.store.db.dialect import serialize_key, upsert
from rollway.store.sql import catalog

M = models.engine_models
P = models.proxy_pause
A = models.model_aliases
U = models.weight_updates
PAUSE_ROW = "proxy"
PAUSE_TURN = "proxy-pause"


# -- the models --------------------------------------------------------------------------------


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
