"""What ``rollway rollouts list`` and ``rollway rollouts show`` do (``rollway/cli/main.py`` declares them and
imports this lazily), over the admin commands' plumbing in ``rollway.cli.commands``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from rich.markup import escape

from rollway.admin.client import AsyncRollwayClient
from rollway.admin.schemas import RolloutRow
from rollway.cli.commands import STATUS_STYLE, Connection, err_console, out_console, print_json, run, when
from rollway.cli.tables import FitTable, render
from rollway.store import Rollout


def rollouts_table(rollouts: list[RolloutRow]) -> FitTable:
    table = FitTable(
        ("rollout", "id"),
        ("status", "name"),
        ("reward", "name"),
        ("mode", "name"),
        ("group", "id"),
        ("#", "name"),
        ("attempts", "name"),
        ("started", "text"),
    )
    for r in rollouts:
        style = STATUS_STYLE.get(r.status, "")
        table.add_row(
            escape(r.rollout_id),
            f"[{style}]{r.status}[/]" if style else str(r.status),
            "" if r.reward is None else f"{r.reward:g}",
            escape(r.mode or ""),
            escape(r.group_id or ""),
            "" if r.group_index is None else str(r.group_index),
            str(r.attempt_count),
            when(r.start_time),
        )
    return table


@dataclass(frozen=True)
class RolloutFilter:
    """Which rollouts ``rollway rollouts list`` shows, and in which order."""

    statuses: tuple[str, ...]
    mode: str | None
    group_id: str | None
    model: str | None
    order: Literal["asc", "desc"]


def list_rollouts(connection: Connection, where: RolloutFilter, limit: int, cursor: str | None, as_json: bool) -> None:
    page = run(
        connection,
        lambda c: c.list_rollouts(
            status=where.statuses or None,
            mode=where.mode,
            group_id=where.group_id,
            model=where.model,
            order=where.order,
            limit=limit,
            cursor=cursor,
        ),
    )
    if as_json:
        print_json(page.model_dump(mode="json"))
        return
    console = out_console()
    console.print(render(console, rollouts_table(page.items)))
    if page.next_cursor:
        again = " --newest-first" if where.order == "desc" else ""
        err_console().print(f"more: --cursor {page.next_cursor}{again}", highlight=False)


def show_rollout(connection: Connection, rollout_id: str, as_json: bool) -> None:
    """The rollout, its attempts, and its latest attempt's spans: each call with its token counts and whether
    its logprobs were recorded, and the reward."""

    async def work(client: AsyncRollwayClient) -> tuple[Rollout, list[Any]]:
        rollout = await client.get_rollout(rollout_id)
        spans = await client.get_spans(rollout_id) if rollout.attempt_count else []
        return rollout, spans

    rollout, spans = run(connection, work)
    if as_json:
        print_json({"rollout": rollout.model_dump(mode="json"), "spans": [s.model_dump(mode="json") for s in spans]})
        return
    console = out_console()
    group = f"{rollout.group_id} #{rollout.group_index}" if rollout.group_id else "—"
    console.print(f"rollout  {escape(rollout.rollout_id)}", highlight=False)
    console.print(f"status   {rollout.status}   mode {rollout.mode or '—'}   group {escape(group)}", highlight=False)
    for attempt in rollout.attempts or []:
        console.print(f"attempt  {attempt.sequence_id}  {attempt.attempt_id}  {attempt.status}", highlight=False)
    table = FitTable(
        ("seq", "name"), ("span", "text"), ("tokens in/out", "name"), ("logprobs", "name"), ("reward", "name")
    )
    for span in spans:
        attributes = span.attributes or {}
        reward = attributes.get("rollway.reward.value")
        ids = attributes.get("rollway.response_token_ids")
        logprobs = attributes.get("rollway.response_logprobs")
        counted = (
            f"{attributes.get('gen_ai.usage.input_tokens', '')}/{attributes.get('gen_ai.usage.output_tokens', '')}"
        )
        table.add_row(
            str(span.sequence_id),
            escape(span.name),
            counted if ids is not None else "",
            ("yes" if logprobs is not None else "[red]none[/]") if ids is not None else "",
            "" if reward is None else f"{reward:g}",
        )
    console.print(render(console, table))
