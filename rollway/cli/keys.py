"""``rollway keys``: Rollway's own API keys minted (printed once) and revoked."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from rollway.cli.admin import JSON_OPTION, admin_command

if TYPE_CHECKING:
    from rollway.cli.commands import Connection


@click.group()
def keys() -> None:
    """Mint and revoke API keys."""


@admin_command(keys, "mint")
@click.option("--scope", type=click.Choice(["gateway", "admin"]), default="gateway", show_default=True)
@click.option("--name", default=None, help="A label for the key.")
@click.option("--expires-in", type=float, default=None, help="Seconds until the key expires.")
@JSON_OPTION
def keys_mint(connection: Connection, scope: str, name: str | None, expires_in: float | None, as_json: bool) -> None:
    """Mint a key; it is printed once."""
    from rollway.cli.commands import mint_key

    mint_key(connection, "admin" if scope == "admin" else "gateway", name, expires_in, as_json)


@admin_command(keys, "revoke")
@click.argument("key_id")
def keys_revoke(connection: Connection, key_id: str) -> None:
    """Revoke a key by its id."""
    from rollway.cli.commands import revoke_key

    revoke_key(connection, key_id)
