"""What the dashboard's browser tests and its bench need: the system's Chromium driven by Playwright, and a real
gateway (``rollway serve`` in a subprocess, its own SQLite file) filled the way ``rollway demo`` fills one.

Chromium is Debian's (``/usr/bin/chromium``; ``.ci/run`` installs it): Playwright drives it as it is, and never
downloads a browser of its own. Without Chromium or Playwright the browser tests skip with one line, unless
``ROLLWAY_REQUIRE_BROWSER=1`` (CI), when they fail instead.
"""

from __future__ import annotations

import asyncio
import io
import os
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
from rich.console import Console

from rollway.cli.demo import DemoOptions, run_loop
from rollway.mock import MockBackendProcess
from rollway.process import GatewayProcess
from support.components import missing

if TYPE_CHECKING:
    from playwright.sync_api import Browser, ConsoleMessage, Page, Playwright

CHROMIUM = os.environ.get("ROLLWAY_CHROMIUM", "/usr/bin/chromium")
#: Headless, and none of Chromium's own connections (updates, sync, field trials): this machine has no network.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
]


def unavailable_reason() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install -e '.[test]')"
    if not (Path(CHROMIUM).exists() or shutil.which(CHROMIUM)):
        return f"no Chromium at {CHROMIUM} (apt-get install chromium)"
    return None


def require_browser() -> None:
    """Called where a test module is imported: skips the whole module (one line) when Chromium or Playwright is
    missing; fails instead under ``ROLLWAY_REQUIRE_BROWSER=1``."""
    reason = unavailable_reason()
    if reason is None:
        return
    missing("browser tests", "ROLLWAY_REQUIRE_BROWSER", reason)


def launch(playwright: Playwright) -> Browser:
    """Chromium with a fresh profile (Playwright gives each launch a new temporary user-data-dir)."""
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)


@dataclass
class Watched:
    """A page with everything it logged as an error, its uncaught exceptions and every URL it requested."""

    page: Page
    errors: list[str] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)

    def problems(self, allowed: tuple[str, ...] = ()) -> list[str]:
        return [e for e in self.errors if not any(a in e for a in allowed)]


@contextmanager
def watched_page(browser: Browser) -> Iterator[Watched]:
    """A fresh browser context (its own session storage) and page, watched for errors."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    try:
        yield watch(context.new_page())
    finally:
        context.close()


def watch(page: Page) -> Watched:
    watched = Watched(page)

    def on_console(message: ConsoleMessage) -> None:
        if message.type == "error":
            watched.errors.append(f"console: {message.text} ({message.location.get('url', '')})")

    page.on("console", on_console)
    page.on("pageerror", lambda exc: watched.errors.append(f"page error: {exc}"))
    page.on("request", lambda request: watched.urls.append(request.url))
    return watched


@dataclass
class Filled:
    """A running gateway, its mock backend, its admin token (or None) and the ids of the rollouts the demo loop
    made."""

    gateway: GatewayProcess
    mock: MockBackendProcess
    token: str | None
    rollout_ids: list[str]

    @property
    def url(self) -> str:
        return self.gateway.url

    def admin(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)


@contextmanager
def filled_gateway(
    folder: Path, *, token: str | None = None, problems: int = 3, group_size: int = 4
) -> Iterator[Filled]:
    """A mock backend and a gateway, filled by ``rollway demo``'s own loop (its model alias, groups of math
    problems, runner workers with the toy agent, rewards): what a user sees after ``rollway demo --db``."""
    with MockBackendProcess(models=["mock-model"]) as mock:
        gateway = GatewayProcess(f"sqlite:///{folder / 'ui.db'}", admin_token=token)
        with gateway:
            options = DemoOptions(out=folder / "triplets.jsonl", problems=problems, group_size=group_size, workers=4)
            output = io.StringIO()
            # In a thread of its own: the caller's thread may be running an event loop (Playwright's sync API).
            with ThreadPoolExecutor(1) as pool:
                loop = run_loop(options, Console(file=output, width=200), mock, gateway)
                assert pool.submit(asyncio.run, loop).result() == 0, output.getvalue()
            filled = Filled(gateway, mock, token, [])
            with filled.admin() as admin:
                listed = admin.get("/admin/v1/rollouts", params={"limit": 1000}).json()["items"]
            filled.rollout_ids = [r["rollout_id"] for r in listed]
            yield filled
