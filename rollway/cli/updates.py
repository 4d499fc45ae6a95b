"""``rollway models update`` and ``rollway models updates``: a weight update in place, and the latest ones, as a
line each (or JSON). Imported when one of them runs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rollway.admin.client import AsyncRollwayClient, WeightUpdateFailed
from rollway.cli.commands import err_console, out_console, print_json, run, when
from rollway.store import WeightUpdate

if TYPE_CHECKING:
    from rollway.cli.commands import Connection


def update_summary(update: WeightUpdate) -> str:
    held = "" if update.held_seconds is None else f" in {update.held_seconds:.2f} s"
    aborted = f", {update.aborted_calls} call(s) aborted" if update.aborted_calls else ""
    line = f"{update.alias}: {update.from_version} → {update.to_version} {update.state}{held}{aborted}"
    return line + (f" ({update.update_id})" if update.state == "committed" else f": {update.error}")


def update_weights(
    connection: Connection, alias: str, version: str | None, options: dict[str, Any], as_json: bool
) -> None:
    """One weight update; its record (JSON) or a line, and exit 1 when it failed."""

    async def work(client: AsyncRollwayClient) -> WeightUpdate:
        try:
            return await client.update_weights(alias, version, **options)
        except WeightUpdateFailed as exc:
            return exc.update

    update = run(connection, work)
    if as_json:
        print_json(update.model_dump(mode="json"))
    else:
        err_console().print(update_summary(update), highlight=False)
    if update.state != "committed":
        raise SystemExit(1)


def list_updates(connection: Connection, alias: str | None, limit: int, as_json: bool) -> None:
    updates = run(connection, lambda c: c.list_updates(alias, limit))
    if as_json:
        print_json([u.model_dump(mode="json") for u in updates])
        return
    if not updates:
        err_console().print("no weight updates yet", highlight=False)
        return
    for update in updates:
        out_console().print(f"{when(update.begun_time)}  {update_summary(update)}", highlight=False)
