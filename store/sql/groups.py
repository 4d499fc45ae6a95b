"""Named groups: where the rollouts of tasks that name a ``group_id`` go in that group (``group_index``) and what
the group's size (``group_size``) becomes, for enqueues and direct starts (``store.sql.queue``).

A group's size is the largest ``group_size`` of its members: ``GET /groups/{id}`` shows it, and an export takes
a group once every member finished and at least that many exist (``store.sql.exports``). A task names a group in
one of three ways:

- *joining* — no ``group_size``: one rollout, at the index after the members the group has; the size grows to
  count it (a group built only this way is as large as its members, whenever you look).
- *sampled* — an enqueued task with ``group_size: n``, the only one of its request to name the group: n rollouts
  of its input at the next n indexes; the size grows by n. A new group so gets 0..n-1.
- *declared member* — a direct start with ``group_size: n`` (n > 1; with 1, a start joins), or one of several
  tasks of an enqueue that name the group, all with the same ``group_size: n``: one rollout each, at the next
  index, and n is the size of the group (not a count): it is complete once n members finished, however they
  arrive (direct starts one at a time, queued tasks, the CLI's batches). A group that has members and another
  size (declared otherwise, or counted by joining members) is refused, and so is a member that would make it
  larger than n (it is full).

Rows that exist already (a request sent again) keep their index and size, and are not checked again. Replicas
joining one group take turns (``serialize_key``: PostgreSQL's advisory lock on the group), so no index is given
twice and no two declared members take the last place.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, RowMapping, select

from rollway.store.db import models
from rollway.store.db.dialect import serialize_key
from rollway.store.errors import StoreValidationError
from rollway.store.schemas import TaskSpec

R = models.rollouts


def declared_sizes(specs: Sequence[TaskSpec]) -> dict[str, int]:
    """The groups an enqueue's tasks join as declared members (several tasks naming the group, all with one
    ``group_size``), with that size. Tasks of one group that give different sizes, or a size to some and none
    to others, are refused: which would the group's size be?"""
    sizes: dict[str, list[int | None]] = defaultdict(list)
    for spec in specs:
        if spec.group_id:
            sizes[spec.group_id].append(spec.group_size)
    declared: dict[str, int] = {}
    for group_id, given in sizes.items():
        distinct = set(given)
        if len(given) == 1 or distinct == {None}:
            continue  # sampled, or joining
        size = distinct.pop()
        if distinct or size is None:
            raise StoreValidationError(
                f"tasks sharing group_id '{group_id}' must all name the same group_size (each is one member of a "
                "group of that size) or all leave it out (each joins the group), got "
                + ", ".join(sorted({"none" if s is None else str(s) for s in given}))
            )
        declared[group_id] = size
    return declared


def join(conn: Connection, named: Iterable[str], planned: list[dict[str, Any]], declared: Mapping[str, int]) -> None:
    """Give the new rows in ``planned`` of the groups ``named`` their ``group_index`` and ``group_size`` (see the
    module docstring); ``declared`` maps the groups whose new rows are declared members to their size."""
    groups = sorted(set(named))
    for group_id in groups:
        serialize_key(conn, "group:" + group_id)
    stored: dict[str, set[str]] = defaultdict(set)
    largest: Counter[str] = Counter()
    query = select(R.c.group_id, R.c.rollout_id, R.c.group_size).where(R.c.group_id.in_(groups))
    for group_id, rollout_id, group_size in conn.execute(query):
        stored[group_id].add(rollout_id)
        largest[group_id] = max(largest[group_id], group_size or 0)
    joining = set(groups)
    new = [row for row in planned if row["group_id"] in joining and row["rollout_id"] not in stored[row["group_id"]]]
    had = Counter({group_id: len(members) for group_id, members in stored.items()})
    adding = Counter(row["group_id"] for row in new)
    size: dict[str, int] = {}
    for group_id in adding:
        if group_id in declared:
            size[group_id] = _room(group_id, declared[group_id], had[group_id], largest[group_id], adding[group_id])
        else:
            size[group_id] = max(had[group_id] + adding[group_id], largest[group_id])
    for row in new:
        row["group_size"], row["group_index"] = size[row["group_id"]], had[row["group_id"]]
        had[row["group_id"]] += 1


def _room(group_id: str, size: int, had: int, largest: int, adding: int) -> int:
    """``size``, when a group with ``had`` members (and size ``largest``) takes ``adding`` declared members."""
    current = max(largest, had)  # a group is as large as its members at least
    if had and current != size:
        raise StoreValidationError(
            f"group '{group_id}' has size {current} ({_members(had)}), not {size}: a member names the group's "
            "size, or leaves group_size out to join the group as it is"
        )
    if had + adding > size:
        more = "another member" if adding == 1 else f"{adding} more members"
        raise StoreValidationError(f"group '{group_id}' of size {size} has {_members(had)}: no room for {more}")
    return size


def _members(n: int) -> str:
    return "1 member" if n == 1 else f"{n} members"


def keeps_sizes(stored: Iterable[RowMapping], declared: Mapping[str, int]) -> bool:
    """Whether rollouts a keyed request made hold the group sizes it declares now (a declared member's row holds
    its group's size exactly): sent again with another size, it is another request."""
    return all(declared.get(row["group_id"], row["group_size"]) == row["group_size"] for row in stored)
