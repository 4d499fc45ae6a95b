"""The export side of the admin client: triplets and trainer records, page after page (``next_cursor`` sent
back as ``since``), as JSON pages or streamed JSON Lines.

Each export hands back ``ExportRecords``: its records, the cursor a later export picks up from, and the running
totals of what the pages left out: the calls de-duplication removed (``deduped_calls``), the samples agent servers
dropped (``removed_samples``) and the groups left out whole for one (``removed_groups``), read from a JSON page's
closing members, a JSON Lines page's headers, or the totals line a streamed one ends with. A trainer reads a
step's records, keeps ``next_cursor``, and asks the next step for ``since=`` that cursor: it gets only what
finished in between, with nothing left out and nothing twice."""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypedDict, TypeVar, Unpack

import httpx

from rollway.admin.client_transport import Transport, query
from rollway.admin.client_types import MergedTriplet, RollwayAPIError, Triplet

CURSOR_HEADER = "x-rollway-next-cursor"
REMOVED_HEADER = "x-rollway-removed-samples"
REMOVED_GROUPS_HEADER = "x-rollway-removed-groups"
#: Asks a streamed JSON Lines page for its totals as its last line (an older server ignores the header).
TOTALS_LINE = {"X-Rollway-Totals": "line"}
#: The members of the line a streamed JSON Lines page ends with (its totals; no record has a ``next_cursor``).
TOTALS = frozenset({"next_cursor", "deduped_calls", "removed_samples", "removed_groups"})
T = TypeVar("T")
U = TypeVar("U")


@dataclass
class _Cursor:
    """Where an export stands: its cursor, the calls de-duplication removed from the rollouts read so far, the
    rollouts the pages read left out as samples their agent server dropped, and the groups left out whole for
    one."""

    value: str | None
    deduped_calls: int = 0
    removed_samples: int = 0
    removed_groups: int = 0
    rollout: tuple[Any, Any] | None = None  # the rollout and attempt of the last record read

    def left_out(self, totals: Mapping[str, Any]) -> None:
        """Add a page's counts of what it left out (absent ones count 0)."""
        self.removed_samples += _int(totals.get("removed_samples"))
        self.removed_groups += _int(totals.get("removed_groups"))

    def count(self, record: Any) -> None:
        """Add the record's ``deduped_calls`` (a SLIME sample's in its ``metadata``) once per rollout: every record
        of a rollout carries its rollout's count, and a rollout's records come one after another."""
        if not isinstance(record, dict):
            return
        source = record if "deduped_calls" in record else record.get("metadata")
        if not isinstance(source, dict) or not isinstance(source.get("deduped_calls"), int):
            return
        rollout = (source.get("rollout_id"), source.get("attempt_id"))
        if rollout != self.rollout:
            self.rollout = rollout
            self.deduped_calls += source["deduped_calls"]


class ExportRecords(Generic[T]):
    """An export's records, page after page (``async for``). ``next_cursor`` is where an export that takes up
    after them begins (pass it as ``since``): the cursor after the last page read to its end, or the ``since``
    this one began from. The records of a page left part-read come again from there, so none is lost."""

    def __init__(self, records: AsyncGenerator[T, None], cursor: _Cursor) -> None:
        self._records = records
        self._cursor = cursor

    @property
    def next_cursor(self) -> str | None:
        return self._cursor.value

    @property
    def deduped_calls(self) -> int:
        """The calls de-duplication removed from the rollouts of the records read so far (the sum of their
        ``deduped_calls``, each rollout once; a rollout that comes again along the cursor counts again)."""
        return self._cursor.deduped_calls

    @property
    def removed_samples(self) -> int:
        """The rollouts the pages read so far left out because their agent server asked to drop their sample
        (unless ``keep_removed``; a page counts once it has been read to its end)."""
        return self._cursor.removed_samples

    @property
    def removed_groups(self) -> int:
        """The groups the pages read so far left out whole because one of their rollouts was such a sample (a
        grouped SLIME export, unless ``keep_short_groups``; their other members are in no other count)."""
        return self._cursor.removed_groups

    def __aiter__(self) -> ExportRecords[T]:
        return self

    async def __anext__(self) -> T:
        return await anext(self._records)

    async def aclose(self) -> None:
        await self._records.aclose()

    def map(self, parse: Callable[[T], U]) -> ExportRecords[U]:
        """The same records, each parsed; the cursor is the same one."""

        async def parsed() -> AsyncGenerator[U, None]:
            async for record in self:
                yield parse(record)

        return ExportRecords(parsed(), self._cursor)


class ExportFilters(TypedDict, total=False):
    """Which finished rollouts an export takes (each as the server's query parameter of the same name)."""

    rollout_id: str | Sequence[str] | None  # only these rollouts, each once finished, whatever its group
    group_id: str | None  # only this group
    mode: Literal["train", "val", "test"] | None  # only rollouts of this mode
    metadata: Mapping[str, str | int | float | bool] | None  # only rollouts whose task metadata holds each key=value
    model_version: str | Sequence[str] | None  # only rollouts whose every LLM call one of these versions answered
    since: str | None  # the cursor to continue from (``next_cursor``; ``"now"``: from now on)
    partial: bool  # each rollout as it finishes, not whole complete groups
    dedupe: bool  # False: keep the calls a later call repeats with the same prompt (default: drop them, and count)
    keep_removed: bool  # True: keep the rollouts whose agent server dropped their sample (merged, SLIME, verl)


def _filter_params(filters: ExportFilters) -> dict[str, Any]:
    versions, metadata = filters.get("model_version"), filters.get("metadata")
    return query(
        group_id=filters.get("group_id"),
        mode=filters.get("mode"),
        partial=filters.get("partial"),
        dedupe=filters.get("dedupe"),
        keep_removed=True if filters.get("keep_removed") else None,  # sent only when asked: servers before it refuse it
        metadata=[f"{k}={json.dumps(v)}" for k, v in metadata.items()] if metadata is not None else None,
        model_version=[versions] if isinstance(versions, str) else None if versions is None else list(versions),
    )


class ExportsMixin:
    """Export iterators of ``AsyncRollwayClient`` (which provides the transport). Each takes the
    ``ExportFilters`` as keywords."""

    _t: Transport

    def iter_triplet_records(
        self, *, merge: bool = False, page_size: int = 500, jsonl: bool = False, **filters: Unpack[ExportFilters]
    ) -> ExportRecords[dict[str, Any]]:
        """Triplets (or with ``merge`` merged rows) of finished rollouts as plain JSON objects, ``page_size``
        rollouts per call, following ``next_cursor`` (sent back as ``since``). With ``jsonl`` each page is
        streamed as JSON Lines (cursor in the ``x-rollway-next-cursor`` header); an error line the server ends a
        broken stream with is raised as ``RollwayAPIError``."""
        params = _filter_params(filters) | query(merge=merge)
        return self._records("/triplets", params, filters, page_size, jsonl)

    def iter_export(
        self,
        kind: Literal["slime", "verl"],
        *,
        page_size: int = 500,
        jsonl: bool = False,
        keep_short_groups: bool = False,
        **filters: Unpack[ExportFilters],
    ) -> ExportRecords[dict[str, Any]]:
        """Trainer records of finished rollouts (``GET /exports/{kind}``): SLIME ``Sample`` fields (``slime``) or
        verl-style rows (``verl``), whole complete groups unless ``partial``, following ``next_cursor``. A grouped
        SLIME export leaves out a group whose member's agent server dropped its sample, unless
        ``keep_short_groups`` (SLIME only; sent only when True)."""
        params = _filter_params(filters) | (query(keep_short_groups=True) if keep_short_groups else {})
        return self._records(f"/exports/{kind}", params, filters, page_size, jsonl)

    def _records(
        self, path: str, params: dict[str, Any], filters: ExportFilters, page_size: int, jsonl: bool
    ) -> ExportRecords[dict[str, Any]]:
        read = _Cursor(filters.get("since"))
        pages = self._iter_pages(path, params, filters.get("rollout_id"), read, page_size, jsonl)
        return ExportRecords(pages, read)

    async def _iter_pages(
        self,
        path: str,
        filters: dict[str, Any],
        rollout_id: str | Sequence[str] | None,
        read: _Cursor,
        page_size: int,
        jsonl: bool,
    ) -> AsyncGenerator[dict[str, Any], None]:
        """The records of an export route, page after page (the cursor sent back as ``since``); ``read`` moves to
        each page's cursor once the page has been read to its end."""
        cursor = read.value
        rollout_ids = [rollout_id] if isinstance(rollout_id, str) else None if rollout_id is None else list(rollout_id)
        while True:
            params = filters | query(rollout_id=rollout_ids, since=cursor, limit=page_size)
            params["format"] = "jsonl" if jsonl else "json"
            next_cursor: str | None = None
            if jsonl:
                sent: dict[str, str | None] = {}  # the cursor and count headers, also of a page with no lines
                request = self._t.build("GET", path, params=params, headers=TOTALS_LINE)
                async for record in self._t.json_lines(request, functools.partial(_keep_cursor, sent)):
                    if isinstance(record, dict) and "next_cursor" in record and record.keys() <= TOTALS:
                        next_cursor = record["next_cursor"]  # the totals line a streamed page ends with
                        read.left_out(record)
                        continue
                    if isinstance(record, dict) and record.keys() == {"error"}:
                        error = record["error"] if isinstance(record["error"], dict) else {}
                        message = str(error.get("message", "the export failed mid-stream"))
                        raise RollwayAPIError(500, message, type=error.get("type"), code=error.get("code"))
                    read.count(record)
                    yield record
                next_cursor = next_cursor or sent.get("cursor")
                read.left_out(sent)
            else:
                page = (await self._t.request("GET", path, params=params)).json()
                next_cursor = page.get("next_cursor")
                read.left_out(page)
                for record in page.get("items", []):
                    read.count(record)
                    yield record
            # A page may be empty yet move the cursor (its rollouts gave no records: cancelled before any call):
            # the end is a cursor that no longer moves.
            if next_cursor:
                read.value = next_cursor
            if not next_cursor or next_cursor == cursor:
                return
            cursor = next_cursor

    def iter_triplets(
        self, *, page_size: int = 500, jsonl: bool = False, **filters: Unpack[ExportFilters]
    ) -> ExportRecords[Triplet]:
        """One ``Triplet`` per LLM call (groups only when complete, unless ``partial``)."""
        records = self.iter_triplet_records(page_size=page_size, jsonl=jsonl, **filters)
        return records.map(Triplet.model_validate)

    def iter_merged_triplets(
        self, *, page_size: int = 500, jsonl: bool = False, **filters: Unpack[ExportFilters]
    ) -> ExportRecords[MergedTriplet]:
        """One ``MergedTriplet`` per multi-turn segment of a rollout (``merge=true``)."""
        records = self.iter_triplet_records(merge=True, page_size=page_size, jsonl=jsonl, **filters)
        return records.map(MergedTriplet.model_validate)


def _keep_cursor(into: dict[str, str | None], response: httpx.Response) -> None:
    into["cursor"] = response.headers.get(CURSOR_HEADER)
    into["removed_samples"] = response.headers.get(REMOVED_HEADER)
    into["removed_groups"] = response.headers.get(REMOVED_GROUPS_HEADER)


def _int(value: Any) -> int:
    """A count as a page gives it (a JSON number, a header's text), 0 when absent."""
    return int(value) if isinstance(value, int | str) and not isinstance(value, bool) and value != "" else 0
