"""Trainer exports (``GET /admin/v1/exports/slime``, ``/exports/verl``): finished rollouts as SLIME
``Sample`` records or verl-style rows (``admin.adapters.trainers``), one JSON page or streamed JSON Lines.

Paging, groups (whole and only once complete unless ``partial=true``), the ``since`` cursor and streaming are
the triplet export's (``admin.triplets``, ``store.sql.exports``): ``limit`` counts rollouts, ``next_cursor`` (also
in the ``x-rollway-next-cursor`` header) continues where the page ended.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

import orjson
from fastapi import APIRouter, Query
from fastapi.responses import Response

from rollway.admin.adapters.trainers import slime_samples, verl_rows
from rollway.admin.context import Context
from rollway.admin.route import AdminRoute
from rollway.admin.triplets import known_parameters, respond
from rollway.store.exports import ExportQuery, ExportRollout

router = APIRouter(tags=["exports"], route_class=AdminRoute)

Builder = Callable[[ExportRollout, bool], list[dict[str, Any]]]
FORMATS = {"slime": slime_samples, "verl": verl_rows}


def renderer(build: Builder, dedupe: bool) -> Callable[[list[ExportRollout]], list[bytes]]:
    def render(rollouts: list[ExportRollout]) -> list[bytes]:
        return [orjson.dumps(record) for rollout in rollouts for record in build(rollout, dedupe)]

    return render


@router.get("/exports/{kind}", response_model=None, dependencies=[known_parameters("format")])
async def export(
    kind: Literal["slime", "verl"],
    context: Context,
    query: Annotated[ExportQuery, Query()],
    format_: Annotated[Literal["json", "jsonl"], Query(alias="format")] = "json",
) -> Response:
    """Finished rollouts as SLIME `Sample` records (`slime`) or verl-style rows (`verl`), one per rollout
    segment; groups come whole and only once complete unless `partial=true`; `since` continues from a
    previous `next_cursor`; `format=jsonl` streams one record per line. The rollouts whose agent server asked
    to drop their sample are left out unless `keep_removed=true`."""
    return await respond(context, query, renderer(FORMATS[kind], query.dedupe), format_, drop_removed=True)
