"""Whether a group can teach anything (``GroupHealth``), from its finished members' LLM calls: read for
``GET /admin/v1/groups/{id}``, and tallied as the exports hand complete groups to a trainer
(``rollway_groups_exported_total``)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import orjson

from rollway.admin.adapters.calls import CALL_OPERATIONS
from rollway.admin.schemas import GroupHealth
from rollway.store.exports import ExportRollout, RawJson

#: The statuses of the members that count: a cancelled member's calls say nothing of the group.
COUNTED = frozenset({"succeeded", "failed"})

Member = tuple[str, Iterable[Mapping[str, Any]]]  # a rollout id and its latest attempt's span attributes


def answers_of(spans: Iterable[Mapping[str, Any]]) -> str | None:
    """A digest of a member's answers (the token ids of each LLM call, in order); None when it made none."""
    calls = [a for a in spans if a.get("gen_ai.operation.name") in CALL_OPERATIONS]
    if not calls:
        return None
    digest = hashlib.blake2b(digest_size=16)
    for attributes in calls:
        ids = attributes.get("rollway.response_token_ids")
        digest.update(ids.text.encode() if isinstance(ids, RawJson) else orjson.dumps(ids))
        digest.update(b"\n")
    return digest.hexdigest()


def health_of(members: Iterable[tuple[str, str | None]]) -> GroupHealth:
    """``GroupHealth`` of members given as (rollout id, ``answers_of`` its spans)."""
    members = list(members)
    without = [rollout_id for rollout_id, answers in members if answers is None]
    answered = [answers for _, answers in members if answers is not None]
    identical = len(answered) > 1 and len(set(answered)) == 1
    return GroupHealth(without_calls=without, identical_answers=identical, degenerate=bool(without) or identical)


def verdict(health: GroupHealth) -> str:
    """The label a group is counted under: ``without_calls``, ``identical_answers`` or ``ok``."""
    if health.without_calls:
        return "without_calls"
    return "identical_answers" if health.identical_answers else "ok"


class ExportedGroups:
    """The groups of one export page, as its chunks are rendered; ``report`` counts each once the page is done.
    Only a grouped export counts (its groups are complete, and a page never splits one)."""

    def __init__(self, count: Callable[[str], None]) -> None:
        self._count = count
        self._members: dict[str, list[tuple[str, str | None]]] = {}

    def add(self, rollouts: Iterable[ExportRollout]) -> None:
        for rollout in rollouts:
            if rollout.group_id is not None and rollout.status in COUNTED:
                members = self._members.setdefault(rollout.group_id, [])
                members.append((rollout.rollout_id, answers_of(s.attributes for s in rollout.spans)))

    def report(self) -> None:
        for members in self._members.values():
            self._count(verdict(health_of(members)))
        self._members.clear()
