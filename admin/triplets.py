"""Training data (``GET /admin/v1/triplets``): finished rollouts as triplets or merged rows, one JSON page or
streamed JSON Lines.

The rules that turn spans into rows are in ``admin.adapters.triplets``; which rollouts a page holds, their
order and the cursor are in ``store.sql.exports``. Rollouts are read and rendered ``CHUNK`` at a time, rendering
in a worker thread, so a large export neither holds every span in memory nor stalls the event loop the
gateway's calls run on.

A page of more than ``CHUNK`` rollouts, and every JSON Lines page, is streamed: the status and the
``x-rollway-next-cursor`` header go out before the rows are read. A page's totals (``Tally``: the calls
de-duplication removed, the samples and groups left out) close a JSON body; a JSON Lines page of at most
``CHUNK`` rollouts sends them as headers. A larger one is read and rendered after its headers went out: a request
that asks with ``X-Rollway-Totals: line`` (the Python client does) gets them as the last line,
``{"next_cursor": …, "deduped_calls": …, "removed_samples": …, "removed_groups": …}``, the one line with a
``next_cursor``; other requests get only records, one per line, as JSON Lines readers expect. Should reading fail
after the status went out, a JSON Lines body ends with an ``{"error": {...}}`` line instead, and a JSON body closes
its items and ends with ``"next_cursor": null`` and an ``"error"`` member: a client that finds an error does not
advance its cursor.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import orjson
from fastapi import APIRouter, Depends, Header, HTTPException, Query, Request
from fastapi.responses import Response, StreamingResponse

from rollway.admin.adapters.calls import deduped, llm_calls
from rollway.admin.adapters.merged import merged_rows
from rollway.admin.adapters.triplets import dumps, triplets
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
#: The rollouts the page left out because their agent server asked to drop their sample (known as above).
REMOVED_HEADER = "x-rollway-removed-samples"
#: The groups the page left out whole because such a rollout was one of them (known as above).
REMOVED_GROUPS_HEADER = "x-rollway-removed-groups"
#: The request header by which a JSON Lines reader asks for a streamed page's totals as its last line (``line``).
TOTALS_REQUEST_HEADER = "x-rollway-totals"
#: A request's ``X-Rollway-Totals`` (only ``line`` means anything).
TotalsLine = Annotated[str | None, Header(alias=TOTALS_REQUEST_HEADER)]
#: Turns a chunk of exported rollouts into JSON documents (triplets here; trainer records in ``admin.exports``).
Renderer = Callable[[list[ExportRollout]], list[bytes]]
JSON = "application/json"
JSONL = "application/x-ndjson"


def render(rollouts: list[ExportRollout], merge: bool, dedupe: bool = True) -> list[bytes]:
    """One JSON document per triplet (or merged row) of each rollout, in order."""
    out: list[bytes] = []
    for r in rollouts:
        build = merged_rows if merge else triplets
        rows: list[Any] = build(
            r.rollout_id,
            r.latest_attempt_id,
            r.spans,
            group_id=r.group_id,
            dedupe=dedupe,
            remove_sample=r.remove_sample,
        )
        out.extend(dumps(row) for row in rows)
    return out


def removed(rollouts: list[ExportRollout], dedupe: bool) -> int:
    """The calls of ``rollouts`` the de-duplication removes (0 when it is off)."""
    return sum(deduped(r.spans, r.latest_attempt_id) for r in rollouts) if dedupe else 0


def made_by(rollout: ExportRollout, versions: frozenset[str]) -> bool:
    """Whether every LLM call (of the latest attempt) was answered by one of ``versions``; a call whose version is
    unknown is none of them."""
    calls = llm_calls(rollout.spans, rollout.latest_attempt_id)
    return all(c.span.attributes.get("rollway.model_version") in versions for c in calls)


@dataclass(frozen=True, slots=True)
class Selection:
    """Which of a page's rollouts give rows: those every call of which one of ``versions`` answered (the
    ``model_version`` filter; None: any), less, with ``drop_removed``, those whose agent server asked to drop
    their sample, and with ``whole_groups`` too the other members of their groups (a SLIME group one short is
    no GRPO group; ``admin.exports``). The page's cursor moves past the others all the same; it reads the
    spans, and sees a group's members together (``chunks``)."""

    versions: frozenset[str] | None = None
    drop_removed: bool = False
    whole_groups: bool = False

    def split(self, rollouts: list[ExportRollout]) -> tuple[list[ExportRollout], Tally]:
        """The rollouts kept, and what was left out of those the version filter let in: the removed samples,
        and the groups left out whole for one (a rollout the version filter leaves out counts in no total, and
        leaves its group be)."""
        versions = self.versions
        chosen = rollouts if versions is None else [r for r in rollouts if made_by(r, versions)]
        if not self.drop_removed:
            return chosen, Tally()
        dropped = [r for r in chosen if r.remove_sample]
        short = {r.group_id for r in dropped if r.group_id is not None} if self.whole_groups else set()
        kept = [r for r in chosen if not r.remove_sample and (r.group_id is None or r.group_id not in short)]
        return kept, Tally(removed_samples=len(dropped), removed_groups=len(short))


@dataclass(slots=True)
class Tally:
    """What a page left out of its rows, summed over its chunks: the calls de-duplication removed from the
    rollouts kept, the rollouts dropped as removed samples, and the groups left out whole for one."""

    deduped_calls: int = 0
    removed_samples: int = 0
    removed_groups: int = 0

    def add(self, rollouts: list[ExportRollout], selection: Selection, dedupe: bool) -> list[ExportRollout]:
        """Count ``rollouts`` in; the ones ``selection`` keeps."""
        kept, dropped = selection.split(rollouts)
        self.deduped_calls += removed(kept, dedupe)
        self.merge(dropped)
        return kept

    def merge(self, other: Tally) -> None:
        self.deduped_calls += other.deduped_calls
        self.removed_samples += other.removed_samples
        self.removed_groups += other.removed_groups

    def json(self) -> bytes:
        """The page's closing members."""
        counts = (self.deduped_calls, self.removed_samples, self.removed_groups)
        return b'"deduped_calls":%d,"removed_samples":%d,"removed_groups":%d' % counts

    def headers(self) -> dict[str, str]:
        return {
            DEDUPED_HEADER: str(self.deduped_calls),
            REMOVED_HEADER: str(self.removed_samples),
            REMOVED_GROUPS_HEADER: str(self.removed_groups),
        }


def chunks(rollouts: list[ExportRollout]) -> Iterator[list[ExportRollout]]:
    """The page's rollouts ``CHUNK`` at a time, each chunk run on to the end of the unit (a whole group, in a
    grouped export) it ends in: a page holds a unit's members next to each other (``store.sql.exports``), so no
    unit is seen in two chunks."""
    start = 0
    while start < len(rollouts):
        end = min(start + CHUNK, len(rollouts))
        while end < len(rollouts) and rollouts[end].export_seq == rollouts[end - 1].export_seq:
            end += 1
        yield rollouts[start:end]
        start = end


def _rendered_chunk(
    render: Renderer, selection: Selection, dedupe: bool, chunk: list[ExportRollout]
) -> tuple[list[bytes], Tally]:
    """The rows of the chunk's kept rollouts, and what the chunk left out (run in a thread)."""
    tally = Tally()
    return render(tally.add(chunk, selection, dedupe)), tally


async def _rendered(
    store: Store,
    page: ExportPage,
    render: Renderer,
    loaded: bool,
    selection: Selection,
    tally: Tally,
    dedupe: bool,
    groups: ExportedGroups | None = None,
) -> AsyncIterator[list[bytes]]:
    """The rows of the rollouts ``selection`` keeps, ``CHUNK`` rollouts at a time (reading their spans first
    unless ``loaded``), counting into ``tally`` what each chunk left out; ``groups`` counts the page's groups by
    health once every chunk is rendered."""
    for chunk in chunks(page.rollouts):
        if not loaded:
            await store.export_spans(chunk)  # of the attempts the page read
        docs, counted = await asyncio.to_thread(_rendered_chunk, render, selection, dedupe, chunk)
        tally.merge(counted)
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
    rendered: AsyncIterator[list[bytes]], page: ExportPage, tally: Tally | None = None
) -> AsyncIterator[bytes]:
    """JSON Lines, then with a ``tally`` the page's totals as the last line; a failure once the stream has begun
    ends it with an ``{"error": …}`` line instead."""
    try:
        async for docs in rendered:
            if docs:
                yield b"\n".join(docs) + b"\n"
    except Exception as exc:
        yield b'{"error":' + _failure(exc) + b"}\n"
        return
    if tally is not None:
        yield b'{"next_cursor":' + orjson.dumps(page.next_cursor) + b"," + tally.json() + b"}\n"


async def _document(rendered: AsyncIterator[list[bytes]], page: ExportPage, tally: Tally) -> AsyncIterator[bytes]:
    """``{"items": [...], "next_cursor": …, "deduped_calls": …, "removed_samples": …, "removed_groups": …}`` in
    pieces; a failure once the stream has begun closes the items and ends the document with ``"next_cursor":
    null`` and an ``"error"`` member."""
    yield b'{"items":['
    separator = b""
    try:
        async for docs in rendered:
            if docs:
                yield separator + b",".join(docs)
                separator = b","
    except Exception as exc:
        yield b'],"next_cursor":null,"error":' + _failure(exc) + b"}"
        return
    yield b'],"next_cursor":' + orjson.dumps(page.next_cursor) + b"," + tally.json() + b"}"


@router.get("/triplets", response_model=None, dependencies=[known_parameters("merge", "format")])
async def export_triplets(
    context: Context,
    query: Annotated[ExportQuery, Query()],
    merge: bool = False,
    format_: Annotated[Literal["json", "jsonl"], Query(alias="format")] = "json",
    totals: TotalsLine = None,
) -> Response:
    """Triplets of finished rollouts (the latest attempt of each): per LLM call, or with `merge=true` one row
    per multi-turn segment. `limit` counts rollouts; groups come whole and only once complete unless
    `partial=true`; `since` continues from a previous `next_cursor` (also in the `x-rollway-next-cursor`
    header). `format=jsonl` streams one row per line, its totals in headers, or with a `limit` over 500 and
    the request header `X-Rollway-Totals: line` in a last line
    `{"next_cursor", "deduped_calls", "removed_samples", "removed_groups"}`. Pages of more than 500
    rollouts are streamed in either format; a failure mid-stream ends the body with an error (see the module
    docstring). Merged rows leave out the rollouts whose agent server asked to drop their sample unless
    `keep_removed=true`; triplets keep them."""
    render_page = functools.partial(render, merge=merge, dedupe=query.dedupe)
    return await respond(context, query, render_page, format_, drop_removed=merge, totals_line=totals == "line")


async def respond(
    context: AdminContext,
    query: ExportQuery,
    render: Renderer,
    format_: Literal["json", "jsonl"],
    *,
    drop_removed: bool,
    whole_groups: bool = False,
    totals_line: bool = False,
) -> Response:
    """The export page ``query`` asks for, rendered by ``render``: a JSON document or JSON Lines, streamed when
    large (the module docstring); shared by the triplet and trainer exports. ``drop_removed``: leave out the
    rollouts whose agent server asked to drop their sample, unless the query keeps them; ``whole_groups``: and,
    in a grouped export, their groups; ``totals_line``: a streamed JSON Lines page ends with its totals. A
    grouped page's groups are counted by health (``admin.groups``) once it is rendered."""
    store = context.store
    groups = None if query.one_by_one else ExportedGroups(context.groups_exported)
    loaded = query.limit <= CHUNK
    versions = None if query.model_versions is None else frozenset(query.model_versions)
    dropping = drop_removed and not query.keep_removed
    selection = Selection(versions, dropping, dropping and whole_groups and not query.one_by_one)
    page = await store.export_rollouts(query, with_spans=loaded)
    headers = {CURSOR_HEADER: page.next_cursor} if page.next_cursor else {}
    tally = Tally()
    if format_ == "jsonl":
        if loaded:  # the totals go out before the body, and the rows count nothing more
            known = Tally()
            known.add(page.rollouts, selection, query.dedupe)
            headers.update(known.headers())
            lines = _lines(_rendered(store, page, render, loaded, selection, tally, False, groups), page)
        else:  # the totals end the body, when asked for
            rendered = _rendered(store, page, render, loaded, selection, tally, query.dedupe, groups)
            lines = _lines(rendered, page, tally if totals_line else None)
        return StreamingResponse(lines, media_type=JSONL, headers=headers)
    rendered = _rendered(store, page, render, loaded, selection, tally, query.dedupe, groups)
    if len(page.rollouts) > CHUNK:
        return StreamingResponse(_document(rendered, page, tally), media_type=JSON, headers=headers)
    docs = [doc async for chunk in rendered for doc in chunk]
    headers.update(tally.headers())
    body = b'{"items":[' + b",".join(docs) + b'],"next_cursor":' + orjson.dumps(page.next_cursor)
    body += b"," + tally.json() + b"}"
    return Response(content=body, media_type=JSON, headers=headers)
