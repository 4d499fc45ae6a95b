"""Training data (``GET /admin/v1/triplets``): finished rollouts as triplets or merged rows, one JSON page or
streamed JSON Lines.

The rules that turn spans into rows are in ``admin.adapters.triplets``; which rollouts a page holds, their
order and the cursor are in ``store.sql.exports``. Rollouts are read and rendered ``CHUNK`` at a time, rendering
in a worker thread, so a large export neither holds every span in memory nor stalls the event loop the
gateway's calls run on.

A page of more than ``CHUNK`` rollouts, and every JSON Lines page, is streamed: the status and the
``x-rollway-next-cursor`` header go out before the rows are read. Should reading fail after that, a JSON Lines
body ends with an ``{"error": {...}}`` line, and a JSON body closes its items and ends with
``"next_cursor": null`` and an ``"error"`` member: a client that finds an error does not advance its cursor.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal

import orjson
from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import Response, StreamingResponse

from rollway.admin.adapters.merged import merged_rows
from rollway.admin.adapters.triplets import deduped, dumps, llm_calls, triplets
from rollway.admin.context import AdminContext, Context
from rollway.admin.groups import ExportedGroups
from rollway.admin.route import AdminRoute
from rollway.envelope import envelope
from rollway.store import Store
from rollway.store.exports import ExportPage, ExportQuery, ExportRollout

log = logging.getLogger("rollway.admin")

router = APIRouter(tags=["triplets"], route_class=AdminRoute)

#: Rollouts read and rendered per step.
CHUNK = 500
#: The query parameters of ``ExportQuery``, by the names the routes take them by.
FILTERS = frozenset(field.alias or name for name, field in ExportQuery.model_fields.items())


def known_parameters(*own: str) -> Any:
    """A dependency that refuses (400) a query parameter the export does not know: a misspelt or unsupported
    filter would otherwise be ignored, and the export would hand back rows it was asked to leave out."""
    known = FILTERS | set(own)

    def check(request: Request) -> None:
        unknown = sorted(set(request.query_params) - known)
        if unknown:
            listed = ", ".join(f"'{name}'" for name in unknown)
            raise HTTPException(400, f"unknown query parameter {listed}: this export takes {', '.join(sorted(known))}")

    return Depends(check)


CURSOR_HEADER = "x-rollway-next-cursor"
#: The calls the page's de-duplication removed, when it is known before the body (a page of at most ``CHUNK``).
DEDUPED_HEADER = "x-rollway-deduped-calls"
#: Turns a chunk of exported rollouts into JSON documents (triplets here; trainer records in ``admin.exports``).
Renderer = Callable[[list[ExportRollout]], list[bytes]]
JSON = "application/json"
JSONL = "application/x-ndjson"


def render(rollouts: list[ExportRollout], merge: bool, dedupe: bool = True) -> list[bytes]:
    """One JSON document per triplet (or merged row) of each rollout, in order."""
    out: list[bytes] = []
    for r in rollouts:
        build = merged_rows if merge else triplets
        rows: list[Any] = build(r.rollout_id, r.latest_attempt_id, r.spans, group_id=r.group_id, dedupe=dedupe)
        out.extend(dumps(row) for row in rows)
    return out


def removed(rollouts: list[ExportRollout], dedupe: bool) -> int:
    """The calls of ``rollouts`` the de-duplication removes (0 when it is off)."""
    return sum(deduped(r.spans, r.latest_attempt_id) for r in rollouts) if dedupe else 0


#: Whether an exported rollout's rows go into the page (the ``model_version`` filter); it reads the spans. The
#: page's cursor still moves past the rollouts it leaves out, and they count in none of the page's totals.
Keep = Callable[[ExportRollout], bool]


def made_by(versions: frozenset[str]) -> Keep:
    """The rollouts whose every LLM call (of the latest attempt) was answered by one of ``versions``; a call whose
    version is unknown is none of them."""

    def kept(rollout: ExportRollout) -> bool:
        return all(
            c.span.attributes.get("rollway.model_version") in versions
            for c in llm_calls(rollout.spans, rollout.latest_attempt_id)
        )

    return kept


def kept(rollouts: list[ExportRollout], keep: Keep | None) -> list[ExportRollout]:
    """The rollouts ``keep`` lets into the page (all of them without a filter)."""
    return rollouts if keep is None else [r for r in rollouts if keep(r)]


def _rendered_chunk(
    render: Renderer, keep: Keep | None, dedupe: bool, chunk: list[ExportRollout]
) -> tuple[list[bytes], int]:
    """The rows of the chunk's kept rollouts, and the calls de-duplication removed from those (run in a thread)."""
    rollouts = kept(chunk, keep)
    return render(rollouts), removed(rollouts, dedupe)


async def _rendered(
    store: Store,
    page: ExportPage,
    render: Renderer,
    loaded: bool,
    keep: Keep | None,
    tally: tuple[bool, list[int]] | None = None,
    groups: ExportedGroups | None = None,
) -> AsyncIterator[list[bytes]]:
    """The rows of the page's rollouts that ``keep`` lets in, ``CHUNK`` rollouts at a time (reading their spans
    first unless ``loaded``); ``tally`` (whether the page is de-duplicated, and a list) collects, per chunk, the
    calls de-duplication removed from the rollouts kept; ``groups`` counts the page's groups by health once every
    chunk is rendered."""
    dedupe = tally is not None and tally[0]
    for start in range(0, len(page.rollouts), CHUNK):
        chunk = page.rollouts[start : start + CHUNK]
        if not loaded:
            await store.export_spans(chunk)  # of the attempts the page read
        docs, calls = await asyncio.to_thread(_rendered_chunk, render, keep, dedupe, chunk)
        if tally is not None:
            tally[1].append(calls)
        if groups is not None:
            groups.add(chunk)
        yield docs
    if groups is not None:
        groups.report()


def _failure(exc: Exception) -> bytes:
    log.error("triplet export failed mid-stream", exc_info=exc)
    message = f"export failed: {type(exc).__name__}"
    return orjson.dumps(envelope(message, "server_error")["error"])


async def _lines(
    store: Store, page: ExportPage, render: Renderer, loaded: bool, keep: Keep | None, groups: ExportedGroups | None
) -> AsyncIterator[bytes]:
    """JSON Lines; a failure once the stream has begun ends it with an ``{"error": …}`` line."""
    try:
        async for docs in _rendered(store, page, render, loaded, keep, groups=groups):
            if docs:
                yield b"\n".join(docs) + b"\n"
    except Exception as exc:
        yield b'{"error":' + _failure(exc) + b"}\n"


async def _document(
    store: Store,
    page: ExportPage,
    render: Renderer,
    loaded: bool,
    keep: Keep | None,
    dedupe: bool,
    groups: ExportedGroups | None,
) -> AsyncIterator[bytes]:
    """``{"items": [...], "next_cursor": …, "deduped_calls": …}`` in pieces; a failure once the stream has begun
    closes the items and ends the document with ``"next_cursor": null`` and an ``"error"`` member."""
    yield b'{"items":['
    separator = b""
    tally: list[int] = []
    try:
        async for docs in _rendered(store, page, render, loaded, keep, (dedupe, tally), groups):
            if docs:
                yield separator + b",".join(docs)
                separator = b","
    except Exception as exc:
        yield b'],"next_cursor":null,"error":' + _failure(exc) + b"}"
        return
    yield b'],"next_cursor":' + orjson.dumps(page.next_cursor) + b',"deduped_calls":' + str(sum(tally)).encode() + b"}"


@router.get("/triplets", response_model=None, dependencies=[known_parameters("merge", "format")])
async def export_triplets(
    context: Context,
    query: Annotated[ExportQuery, Query()],
    merge: bool = False,
    format_: Annotated[Literal["json", "jsonl"], Query(alias="format")] = "json",
) -> Response:
    """Triplets of finished rollouts (the latest attempt of each): per LLM call, or with `merge=true` one row
    per multi-turn segment. `limit` counts rollouts; groups come whole and only once complete unless
    `partial=true`; `since` continues from a previous `next_cursor` (also in the `x-rollway-next-cursor`
    header). `format=jsonl` streams one row per line. Pages of more than 500 rollouts are streamed in either
    format; a failure mid-stream ends the body with an error (see the module docstring)."""
    return await respond(context, query, functools.partial(render, merge=merge, dedupe=query.dedupe), format_)


async def respond(
    context: AdminContext, query: ExportQuery, render: Renderer, format_: Literal["json", "jsonl"]
) -> Response:
    """The export page ``query`` asks for, rendered by ``render``: a JSON document or JSON Lines, streamed when
    large (the module docstring); shared by the triplet and trainer exports. A grouped page's groups are counted
    by health (``admin.groups``) once it is rendered."""
    store = context.store
    groups = None if query.one_by_one else ExportedGroups(context.groups_exported)
    loaded = query.limit <= CHUNK
    keep = None if query.model_versions is None else made_by(frozenset(query.model_versions))
    page = await store.export_rollouts(query, with_spans=loaded)
    headers = {CURSOR_HEADER: page.next_cursor} if page.next_cursor else {}
    if format_ == "jsonl":
        if loaded:
            headers[DEDUPED_HEADER] = str(removed(kept(page.rollouts, keep), query.dedupe))
        lines = _lines(store, page, render, loaded, keep, groups)
        return StreamingResponse(lines, media_type=JSONL, headers=headers)
    if len(page.rollouts) > CHUNK:
        pieces = _document(store, page, render, loaded, keep, query.dedupe, groups)
        return StreamingResponse(pieces, media_type=JSON, headers=headers)
    tally: list[int] = []
    rendered = _rendered(store, page, render, loaded, keep, (query.dedupe, tally), groups)
    docs = [doc async for chunk in rendered for doc in chunk]
    headers[DEDUPED_HEADER] = str(sum(tally))
    body = b'{"items":[' + b",".join(docs) + b'],"next_cursor":' + orjson.dumps(page.next_cursor)
    body += b',"deduped_calls":' + headers[DEDUPED_HEADER].encode() + b"}"
    return Response(content=body, media_type=JSON, headers=headers)
