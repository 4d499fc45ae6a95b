"""The plumbing of ``rollway``'s admin commands: each talks to a running gateway through the admin client
(its implementation in ``rollway/cli/commands.py``, imported when the command runs)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import click


def admin_command(group: click.Group, name: str) -> Callable[[Callable[..., None]], click.Command]:
    """A command that talks to a running gateway: it takes ``--url``/``--token`` (else the global ones) and
    receives them as its first argument, a ``Connection``."""

    def decorate(function: Callable[..., None]) -> click.Command:
        @functools.wraps(function)
        def command(url: str | None, token: str | None, **kwargs: Any) -> None:
            from rollway.cli.commands import Connection

            root = click.get_current_context().find_root().params
            function(Connection(url or root["url"], token or root["token"]), **kwargs)

        command = click.option("--token", default=None, help="Admin token (overrides the global --token).")(command)
        command = click.option("--url", default=None, help="Gateway URL (overrides the global --url).")(command)
        return group.command(name)(command)

    return decorate


JSON_OPTION = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
