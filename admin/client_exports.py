"""The export side of the admin client: triplets and trainer records, page after page (``next_cursor`` sent
back as ``since``), as JSON pages or streamed JSON Lines."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

import httpx

from rollway.admin.client_transport import Transport, query
from rollway.admin.client_types import MergedTriplet, RollwayAPIError, Triplet

CURSOR_HEADER = "x-rollway-next-cursor"


class ExportsMixin:
    """Export iterators of ``AsyncRollwayClient`` (which provides the transport)."""

    _t: Transport

    async def iter_triplet_records(
        self,
        *,
        rollout_id: str | Sequence[str] | None = None,
        group_id: str | None = None,
        since: str | None = None,
        merge: bool = False,
        partial: bool = False,
        page_size: int = 500,
        jsonl: bool = False,
    ) -> AsyncIterator[dict[str, Any]]:
        """Triplets (or with ``merge`` merged rows) of finished rollouts as plain JSON objects, ``page_size``
        rollouts per call, following ``next_cursor`` (sent back as ``since``). With ``jsonl`` each page is
        streamed as JSON Lines (cursor in the ``x-rollway-next-cursor`` header); an error line the server ends a
        broken stream with is raised as ``RollwayAPIError``."""
        params = query(group_id=group_id, merge=merge, partial=partial)
        async for record in self._iter_pages("/triplets", params, rollout_id, since, page_size, jsonl):
            yield record

    async def iter_export(
        self,
        kind: Literal["slime", "verl"],
        *,
        rollout_id: str | Sequence[str] | None = None,
        group_id: str | None = None,
        since: str | None = None,
        partial: bool = False,
        page_size: int = 500,
        jsonl: bool = False,
    ) -> AsyncIterator[dict[str, Any]]:
        """Trainer records of finished rollouts (``GET /exports/{kind}``): SLIME ``Sample`` fields (``slime``) or
        verl-style rows (``verl``), whole complete groups unless ``partial``, following ``next_cursor``."""
        params = query(group_id=group_id, partial=partial)
        async for record in self._iter_pages(f"/exports/{kind}", params, rollout_id, since, page_size, jsonl):
            yield record

    async def _iter_pages(
        self,
        path: str,
        filters: dict[str, Any],
        rollout_id: str | Sequence[str] | None,
        since: str | None,
        page_size: int,
        jsonl: bool,
    ) -> AsyncIterator[dict[str, Any]]:
        """The records of an export route, page after page (the cursor sent back as ``since``)."""
        cursor = since
        rollout_ids = [rollout_id] if isinstance(rollout_id, str) else None if rollout_id is None else list(rollout_id)
        while True:
            params = filters | query(rollout_id=rollout_ids, since=cursor, limit=page_size)
            params["format"] = "jsonl" if jsonl else "json"
            next_cursor: str | None = None
            if jsonl:
                sent: dict[str, str | None] = {}  # the cursor header, also of a page with no lines
                request = self._t.build("GET", path, params=params)
                async for record in self._t.json_lines(request, functools.partial(_keep_cursor, sent)):
                    if isinstance(record, dict) and record.keys() == {"next_cursor"}:
                        next_cursor = record["next_cursor"]
                        continue
                    if isinstance(record, dict) and record.keys() == {"error"}:
                        error = record["error"] if isinstance(record["error"], dict) else {}
                        message = str(error.get("message", "the export failed mid-stream"))
                        raise RollwayAPIError(500, message, type=error.get("type"), code=error.get("code"))
                    yield record
                next_cursor = next_cursor or sent.get("cursor")
            else:
                page = (await self._t.request("GET", path, params=params)).json()
                next_cursor = page.get("next_cursor")
                for record in page.get("items", []):
                    yield record
            # A page may be empty yet move the cursor (its rollouts gave no records: cancelled before any call):
            # the end is a cursor that no longer moves.
            if not next_cursor or next_cursor == cursor:
                return
            cursor = next_cursor

    async def iter_triplets(
        self,
        *,
        rollout_id: str | Sequence[str] | None = None,
        group_id: str | None = None,
        since: str | None = None,
        partial: bool = False,
        page_size: int = 500,
        jsonl: bool = False,
    ) -> AsyncIterator[Triplet]:
        """One ``Triplet`` per LLM call (groups only when complete, unless ``partial``)."""
        records = self.iter_triplet_records(
            rollout_id=rollout_id, group_id=group_id, since=since, partial=partial, page_size=page_size, jsonl=jsonl
        )
        async for record in records:
            yield Triplet.model_validate(record)

    async def iter_merged_triplets(
        self,
        *,
        rollout_id: str | Sequence[str] | None = None,
        group_id: str | None = None,
        since: str | None = None,
        partial: bool = False,
        page_size: int = 500,
        jsonl: bool = False,
    ) -> AsyncIterator[MergedTriplet]:
        """One ``MergedTriplet`` per multi-turn segment of a rollout (``merge=true``)."""
        records = self.iter_triplet_records(
            rollout_id=rollout_id,
            group_id=group_id,
            since=since,
            merge=True,
            partial=partial,
            page_size=page_size,
            jsonl=jsonl,
        )
        async for record in records:
            yield MergedTriplet.model_validate(record)


def _keep_cursor(into: dict[str, str | None], response: httpx.Response) -> None:
    into["cursor"] = response.headers.get(CURSOR_HEADER)
