"""``rollway triplets export`` and ``rollway export slime|verl``: training data written as JSON Lines, with the
options every export takes (``rollway/cli/exports.py`` does the work, imported when a command runs)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import click

from rollway.cli.admin import admin_command, parent_exists

if TYPE_CHECKING:
    from rollway.cli.commands import Connection


def _export_filters(command: Callable[..., None]) -> Callable[..., None]:
    """The options every export takes to pick rollouts by mode, task metadata and model version."""
    options = [
        click.option("--mode", type=click.Choice(["train", "val", "test"]), default=None, help="Only this mode."),
        click.option("--metadata", multiple=True, help="Only tasks whose metadata has KEY=VALUE (repeatable)."),
        click.option(
            "--model-version", "model_version", multiple=True, help="Only rollouts this version made (repeatable)."
        ),
        click.option(
            "--keep-retries/--dedupe", "keep_retries", default=False, help="Keep calls a later one repeats exactly."
        ),
        click.option(
            "--keep-removed",
            "keep_removed",
            is_flag=True,
            help="Keep rollouts whose agent server dropped their sample (merged rows, SLIME, verl).",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


@click.group()
def triplets() -> None:
    """Export training data."""


@admin_command(triplets, "export")
@click.argument("out", type=click.Path(dir_okay=False, allow_dash=True), callback=parent_exists)
@click.option("--merge", is_flag=True, help="One multi-turn row per rollout segment (token_ids + loss_mask).")
@click.option("--rollout-id", "rollout_id", multiple=True, help="Only this rollout (repeatable).")
@click.option("--group-id", default=None, help="Only this group.")
@click.option("--since", default=None, help="Only what finished after this cursor.")
@click.option("--partial", is_flag=True, help="Also incomplete groups.")
@click.option("--page-size", type=click.IntRange(1, 10_000), default=500, show_default=True, help="Rollouts per call.")
@click.option("--stream", "jsonl", is_flag=True, help="Fetch pages as streamed JSON Lines.")
@_export_filters
def triplets_export(connection: Connection, out: str, rollout_id: tuple[str, ...], **query: Any) -> None:
    """Write triplets (per LLM call, with token ids, logprobs and rewards) as JSON Lines to OUT ('-': stdout)."""
    from rollway.cli.exports import triplets_export as export

    export(connection, out, rollout_id=list(rollout_id) or None, **query)


@click.group()
def export() -> None:
    """Export training data for a trainer (SLIME samples, verl rows)."""


def _trainer_export(kind: Literal["slime", "verl"], what: str) -> None:
    def command(connection: Connection, out: str, rollout_id: tuple[str, ...], **query: Any) -> None:
        from rollway.cli.exports import trainer_export

        trainer_export(connection, kind, out, rollout_id=list(rollout_id) or None, **query)

    command.__doc__ = f"Write {what} of finished rollouts (whole groups) as JSON Lines to OUT ('-': stdout)."
    options = [
        click.argument("out", type=click.Path(dir_okay=False, allow_dash=True), callback=parent_exists),
        click.option("--rollout-id", "rollout_id", multiple=True, help="Only this rollout (repeatable)."),
        click.option("--group-id", default=None, help="Only this group."),
        click.option("--since", default=None, help="Only what finished after this cursor."),
        click.option("--partial", is_flag=True, help="Also incomplete groups."),
        click.option(
            "--page-size", type=click.IntRange(1, 10_000), default=500, show_default=True, help="Rollouts/call."
        ),
        click.option("--stream", "jsonl", is_flag=True, help="Fetch pages as streamed JSON Lines."),
    ]
    if kind == "slime":  # verl rows keep a group's other members always
        options.append(
            click.option(
                "--keep-short-groups",
                "keep_short_groups",
                is_flag=True,
                help="Keep the other members of a group one of whose samples was dropped.",
            )
        )
    decorated: Callable[..., None] = _export_filters(command)
    for option in reversed(options):
        decorated = option(decorated)
    admin_command(export, kind)(decorated)


_trainer_export("slime", "SLIME Sample records (tokens, response_length, loss_mask, reward, log probs)")
_trainer_export("verl", "verl-style rows (prompt/response ids, response mask, token-level scores)")
