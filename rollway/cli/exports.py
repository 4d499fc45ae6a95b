"""The export commands: triplets (or merged rows), SLIME samples and verl rows as JSON Lines, to stdout or to a
file that is written whole or not at all, with a running count on stderr."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal

import click
from rich.markup import escape

from rollway.admin.client import AsyncRollwayClient
from rollway.admin.client_exports import ExportRecords
from rollway.cli.commands import Connection, err_console, progress_bar, run

if TYPE_CHECKING:
    from rich.progress import Progress


@contextlib.contextmanager
def _output(path: str) -> Iterator[IO[str]]:
    if path == "-":
        yield sys.stdout
        return
    target = Path(path)
    partial = target.with_name(target.name + ".part")
    try:
        with open(partial, "w", encoding="utf-8") as handle:
            yield handle
    except BaseException:
        partial.unlink(missing_ok=True)  # a broken export leaves no half-written file behind
        raise
    partial.replace(target)


async def write_lines(
    records: AsyncIterator[dict[str, Any]], out: IO[str], progress: Progress | None, label: str
) -> int:
    """Write each record as one JSON line; the number written."""
    task_id = progress.add_task(label, total=None) if progress is not None else None
    count = 0
    async for record in records:
        out.write(json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n")
        count += 1
        if progress is not None and task_id is not None:
            progress.advance(task_id)
    return count


async def export_triplets(client: AsyncRollwayClient, out: IO[str], progress: Progress | None, **query: Any) -> int:
    """Write every matching triplet as one JSON line; the number written."""
    return await write_lines(client.iter_triplet_records(**query), out, progress, "Exporting triplets")


def _export(
    connection: Connection,
    out: str,
    label: str,
    noun: str,
    records: Callable[[AsyncRollwayClient], ExportRecords[dict[str, Any]]],
) -> None:
    """Write the records to ``out``, then say how many, how many repeated calls the de-duplication removed from
    their rollouts (the sum of the rows' ``deduped_calls``, each rollout once), how many rollouts were left out
    as samples their agent server dropped, and how many groups were left out whole with them."""

    async def work(client: AsyncRollwayClient) -> tuple[int, int, int, int]:
        with _output(out) as handle, progress_bar(counted=False) as progress:
            exported = records(client)
            count = await write_lines(exported, handle, progress, label)
            return count, exported.deduped_calls, exported.removed_samples, exported.removed_groups

    count, deduped, dropped, groups = run(connection, work)
    where = "stdout" if out == "-" else escape(out)
    notes = [f"{deduped} repeated calls removed; --keep-retries keeps them"] if deduped else []
    if dropped:
        notes.append(f"{dropped} rollouts left out as their agent server asked; --keep-removed keeps them")
    if groups:
        notes.append(f"{groups} groups left out whole with them; --keep-short-groups keeps their other members")
    summary = f" ({'; '.join(notes)})" if notes else ""
    err_console().print(f"Wrote [bold]{count}[/] {noun} to {where}{summary}")


def filters(query: dict[str, Any]) -> dict[str, Any]:
    """The command's filter options as the client takes them: ``--metadata KEY=VALUE`` (the value read as JSON
    when it parses) into a mapping, repeated ``--model-version`` into a list; ``--keep-retries`` and
    ``--keep-removed`` only when given."""
    pairs, versions = query.pop("metadata", ()), query.pop("model_version", ())
    if query.pop("keep_retries", False):
        query["dedupe"] = False
    if query.pop("keep_removed", False):
        query["keep_removed"] = True
    if pairs:
        metadata: dict[str, Any] = {}
        for pair in pairs:
            key, sep, raw = pair.partition("=")
            if not sep or not key:
                raise click.BadParameter(f"{pair!r}: write it as KEY=VALUE", param_hint="--metadata")
            try:
                metadata[key] = json.loads(raw)
            except ValueError:
                metadata[key] = raw
        query["metadata"] = metadata
    if versions:
        query["model_version"] = list(versions)
    return query


def triplets_export(connection: Connection, out: str, **query: Any) -> None:
    query = filters(query)
    noun = "merged rows" if query.get("merge") else "triplets"
    _export(connection, out, "Exporting triplets", noun, lambda client: client.iter_triplet_records(**query))


def trainer_export(connection: Connection, kind: Literal["slime", "verl"], out: str, **query: Any) -> None:
    """Write SLIME ``Sample`` records or verl rows as JSON Lines to ``out`` ('-': stdout)."""
    query = filters(query)

    def records(client: AsyncRollwayClient) -> ExportRecords[dict[str, Any]]:
        return client.iter_export(kind, **query)

    _export(connection, out, f"Exporting {kind} records", f"{kind} records", records)
