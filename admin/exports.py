"""Trainer exports (``GET /admin/v1/exports/slime``, ``/exports/verl``): finished rollouts as SLIME
``Sample`` records or verl-style rows (``admin.adapters.trainers``), one JSON page or streamed JSON Lines.

Paging, groups (whole and only once complete unless ``partial=true``), the ``since`` cursor and streaming are
the triplet export's (``admin.triplets``, ``store.sql.exports``): ``limit`` counts rollouts, ``next_cursor`` (also
in the ``x-rollway-next-cursor`` header) continues where the page ended.

A rollout whose agent server asked to drop its sample (``remove_sample``) is left out of both unless
``keep_removed=true``. A grouped SLIME export leaves out its whole group with it (counted in ``removed_groups``):
SLIME counts on ``n_samples_per_prompt`` samples in every group, and GRPO's group advantage over the others would
be taken over one sample fewer than the group was drawn with. ``keep_short_groups=true`` keeps the group's other
members. verl rows keep them always: verl's GRPO groups by ``uid`` whatever a group's size. Kept
(``keep_removed``), a SLIME sample says so in SLIME's own ``Sample.remove_sample``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

import orjson
from fastapi import APIRouter, HTTPException, Query
from fastapi.responses import Response

from rollway.admin.adapters.trainers import slime_samples, verl_rows
from rollway.admin.context import Context
from rollway.admin.route import AdminRoute
from rollway.admin.triplets import TotalsLine, known_parameters, respond
from rollway.store.exports import ExportQuery, ExportRollout

router = APIRouter(tags=["exports"], route_class=AdminRoute)

Builder = Callable[[ExportRollout, bool], list[dict[str, Any]]]
FORMATS = {"slime": slime_samples, "verl": verl_rows}


def renderer(build: Builder, dedupe: bool) -> Callable[[list[ExportRollout]], list[bytes]]:
    def render(rollouts: list[ExportRollout]) -> list[bytes]:
        return [orjson.dumps(record) for rollout in rollouts for record in build(rollout, dedupe)]

    return render


@router.get("/exports/{kind}", response_model=None, dependencies=[known_parameters("format", "keep_short_groups")])
async def export(
    kind: Literal["slime", "verl"],
    context: Context,
    query: Annotated[ExportQuery, Query()],
    format_: Annotated[Literal["json", "jsonl"], Query(alias="format")] = "json",
    keep_short_groups: Annotated[
        bool | None,
        Query(
            description="SLIME only: keep the other members of a group one of whose rollouts is left out as a "
            "sample its agent server dropped (by default the group is left out whole, and counted in "
            "`removed_groups`)"
        ),
    ] = None,
    totals: TotalsLine = None,
) -> Response:
    """Finished rollouts as SLIME `Sample` records (`slime`) or verl-style rows (`verl`), one per rollout
    segment; groups come whole and only once complete unless `partial=true`; `since` continues from a
    previous `next_cursor`; `format=jsonl` streams one record per line (a page of over 500 rollouts ends with
    its totals line when asked with `X-Rollway-Totals: line`, as for `/triplets`). The rollouts whose agent
    server asked to drop their sample are left out unless `keep_removed=true`, and in a grouped SLIME export
    their whole groups with them unless `keep_short_groups=true` (SLIME only: verl rows keep a group's other
    members)."""
    if kind == "verl" and keep_short_groups is not None:
        raise HTTPException(400, "keep_short_groups is the SLIME export's: verl rows keep a group's other members")
    build = renderer(FORMATS[kind], query.dedupe)
    whole_groups = kind == "slime" and not keep_short_groups
    return await respond(
        context, query, build, format_, drop_removed=True, whole_groups=whole_groups, totals_line=totals == "line"
    )
