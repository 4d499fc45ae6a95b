"""``rollway agents``: remote agent servers (the Osmosis protocol) registered, listed and deleted."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import click

from rollway.cli.admin import JSON_OPTION, admin_command

if TYPE_CHECKING:
    from rollway.cli.commands import Connection


@click.group()
def agents() -> None:
    """Register remote agent servers (Osmosis protocol)."""


@admin_command(agents, "put")
@click.argument("name")
@click.argument("server_url", metavar="URL")
@click.option("--api-key", default=None, help="Sent to the server as Authorization: Bearer (stored, never shown).")
@click.option("--max-concurrent", type=click.IntRange(1, 100_000), default=None, help="Rollouts at once.")
@click.option("--param", "params", multiple=True, help="A completion parameter KEY=VALUE (JSON value), repeatable.")
@click.option(
    "--protocol",
    type=click.Choice(["v1", "0.3"]),
    default=None,
    help="The Osmosis protocol it speaks, so its /health is not read (else told by its /health).",
)
@JSON_OPTION
def agents_put(
    connection: Connection,
    name: str,
    server_url: str,
    api_key: str | None,
    max_concurrent: int | None,
    params: tuple[str, ...],
    protocol: str | None,
    as_json: bool,
) -> None:
    """Register (or replace) remote agent server NAME at URL (an Osmosis agent server: v1's or 0.3's, told from
    its /health unless --protocol names it); tasks enqueued with agent: NAME are dispatched to it."""
    from rollway.cli.commands import agents_put as put

    completion: dict[str, Any] = {}
    for item in params:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"'{item}' is not KEY=VALUE", param_hint="--param")
        try:
            completion[key] = json.loads(value)
        except json.JSONDecodeError:
            completion[key] = value
    put(
        connection,
        name,
        as_json,
        url=server_url,
        api_key=api_key,
        max_concurrent=max_concurrent,
        completion_params=completion or None,
        protocol=protocol,
    )


@admin_command(agents, "list")
@JSON_OPTION
def agents_list(connection: Connection, as_json: bool) -> None:
    """List the registered agent servers (never their api keys)."""
    from rollway.cli.commands import agents_list as show

    show(connection, as_json)


@admin_command(agents, "delete")
@click.argument("name")
def agents_delete(connection: Connection, name: str) -> None:
    """Unregister agent server NAME (its queued tasks wait for a server of that name)."""
    from rollway.cli.commands import agents_delete as delete

    delete(connection, name)
