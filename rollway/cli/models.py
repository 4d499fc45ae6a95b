"""``rollway models``: model aliases and their backends (put, swap, list, pause, resume, delete, drain), and their
weight updates (update, updates)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from rollway.cli.admin import JSON_OPTION, admin_command

if TYPE_CHECKING:
    from rollway.cli.commands import Connection

BACKEND_KINDS = click.Choice(["auto", "vllm", "sglang", "openai", "litellm"])


@click.group()
def models() -> None:
    """Manage model aliases and their backends."""


def backend_options(required: bool) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """The options of one backend; ``required`` for ``put`` (``swap`` may change the version only, and its
    ``--kind`` defaults to the alias's own: a swap to the next weights must not stop the token-id capture)."""
    kind = (
        click.option(
            "--kind",
            type=BACKEND_KINDS,
            default="auto",
            show_default=True,
            help="Backend kind: auto asks the server (vLLM and SGLang get their token ids recorded).",
        )
        if required
        else click.option("--kind", type=BACKEND_KINDS, default=None, help="Backend kind [default: the alias's].")
    )

    def decorate(function: Callable[..., None]) -> Callable[..., None]:
        options = [
            click.option("--backend", "base_url", required=required, help="Backend base URL (…/v1)."),
            kind,
            click.option("--model", "upstream_model", required=required, help="Model name at the backend."),
            click.option(
                "--api-key",
                default=None,
                envvar="ROLLWAY_BACKEND_API_KEY",
                help="Backend API key (never shown again) [env: ROLLWAY_BACKEND_API_KEY: on the command line a key "
                "shows in ps and the shell's history].",
            ),
            click.option("--backend-id", default=None, help="Backend id [default: generated]."),
            click.option("--weight", type=float, default=None, help="Routing weight."),
            click.option("--max-concurrency", type=int, default=None, help="Most calls in flight to it."),
        ]
        for option in reversed(options):
            function = option(function)
        return function

    return decorate


@admin_command(models, "put")
@click.argument("alias")
@backend_options(required=True)
@click.option("--version", default=None, help="Model version [default: previous + 1].")
@JSON_OPTION
def models_put(connection: Connection, alias: str, version: str | None, as_json: bool, **backend: Any) -> None:
    """Create or replace ALIAS with one backend."""
    from rollway.cli.model_commands import backend_spec, put_model

    spec = backend_spec(backend.pop("base_url"), backend.pop("kind"), backend.pop("upstream_model"), **backend)
    put_model(connection, alias, spec, version, as_json)


@admin_command(models, "swap")
@click.argument("alias")
@backend_options(required=False)
@click.option("--version", default=None, help="New model version [default: previous + 1].")
@click.option("--drain-timeout", type=float, default=None, help="Also wait up to this long for old calls.")
@JSON_OPTION
def models_swap(
    connection: Connection, alias: str, version: str | None, drain_timeout: float | None, as_json: bool, **backend: Any
) -> None:
    """Swap ALIAS atomically to a new backend (--backend/--model) and/or --version."""
    from rollway.cli.model_commands import backend_spec, swap_model

    base_url, kind, upstream_model = backend.pop("base_url"), backend.pop("kind"), backend.pop("upstream_model")
    if (base_url is None) != (upstream_model is None):
        raise click.UsageError("--backend and --model go together")
    spec = None if base_url is None else backend_spec(base_url, kind, upstream_model, **backend)
    swap_model(connection, alias, spec, version, drain_timeout, as_json)


@admin_command(models, "list")
@JSON_OPTION
def models_list(connection: Connection, as_json: bool) -> None:
    """List model aliases, their backends and state."""
    from rollway.cli.model_commands import model_action

    model_action(connection, "list", None, as_json)


def _model_action(name: str, action: str, help_text: str) -> None:
    @admin_command(models, name)
    @click.argument("alias")
    @JSON_OPTION
    def command(connection: Connection, alias: str, as_json: bool) -> None:
        from rollway.cli.model_commands import model_action

        model_action(connection, action, alias, as_json)

    command.help = help_text


_model_action("pause", "pause", "Pause ALIAS: new calls wait (then 429); calls in flight go on.")
_model_action("resume", "resume", "Resume a paused ALIAS.")
_model_action("delete", "delete", "Delete ALIAS.")


@admin_command(models, "drain")
@click.argument("alias")
@click.option("--timeout", type=click.FloatRange(0, 600), default=30.0, show_default=True, help="Seconds to wait.")
@JSON_OPTION
def models_drain(connection: Connection, alias: str, timeout: float, as_json: bool) -> None:
    """Wait until no call of ALIAS is in flight in any gateway replica (pause it first); exit 1 on timeout."""
    from rollway.cli.model_commands import drain_model

    drain_model(connection, alias, timeout, as_json)


@admin_command(models, "update")
@click.argument("alias")
@click.option("--version", default=None, help="The new weights' version [default: previous + 1].")
@click.option(
    "--abort-in-flight", is_flag=True, help="End the calls in flight (recorded as aborted) instead of draining them."
)
@click.option(
    "--drain-timeout",
    type=click.FloatRange(0, 3600),
    default=60.0,
    show_default=True,
    help="Seconds the calls in flight may take to end.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(0, 86400, min_open=True),
    default=600.0,
    show_default=True,
    help="Seconds each engine call may take.",
)
@click.option("--weights-path", default=None, help="Reload from this folder [default: the model's own].")
@click.option("--note", default=None, help="Kept with the update's record.")
@JSON_OPTION
def models_update(
    connection: Connection,
    alias: str,
    version: str | None,
    abort_in_flight: bool,
    drain_timeout: float,
    timeout: float,
    weights_path: str | None,
    note: str | None,
    as_json: bool,
) -> None:
    """Reload ALIAS's weights in place on its engines (vLLM in dev mode, SGLang), as one operation: new calls
    held, calls in flight drained, version bumped, resumed. Exit 1 when it failed (the alias is then back on its
    old version)."""
    from rollway.cli.updates import update_weights

    options: dict[str, Any] = {
        "in_flight": "abort" if abort_in_flight else "drain",
        "drain_timeout_seconds": drain_timeout,
    }
    options |= {"timeout_seconds": timeout, "weights_path": weights_path, "note": note}
    update_weights(connection, alias, version, options, as_json)


@admin_command(models, "updates")
@click.argument("alias", required=False)
@click.option("--limit", type=click.IntRange(1, 500), default=20, show_default=True, help="Most updates shown.")
@JSON_OPTION
def models_updates(connection: Connection, alias: str | None, limit: int, as_json: bool) -> None:
    """List the latest weight updates (of ALIAS, when given), newest first."""
    from rollway.cli.updates import list_updates

    list_updates(connection, alias, limit, as_json)
