"""Web pages the operator opens cannot use Rollway (docs/security.md, "Web pages"), in a real headless Chromium
against ``rollway serve`` with an admin token and without one, its gateway auth left at ``none``.

Two attackers: a page on another origin (a second loopback server, so that no browser rule about reaching local
addresses stops it before Rollway does), which posts across sites the way browsers allow without a CORS
preflight (``no-cors``, ``text/plain`` or no type) and tries to read answers; and a DNS-rebinding page, whose own
host name (``rebind.test``, mapped to 127.0.0.1 by Chromium's resolver rules) points at Rollway, so that its
requests are same-origin and it could read whatever Rollway answered. Each test checks what Rollway answered
(the statuses Chromium saw), that nothing was recorded (no span in the store, the model not paused) and that
the backend received nothing, and that the same requests from Rollway's own origin do get through.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from rollway.mock import MockBackendProcess
from rollway.process import GatewayProcess
from support.ui_env import CHROMIUM, CHROMIUM_ARGS, require_browser

require_browser()

from playwright.sync_api import Browser, Page, Playwright, Request, Response, sync_playwright  # noqa: E402

pytestmark = [pytest.mark.real_component, pytest.mark.slow]
TOKEN = "admin-token-of-the-cross-site-test"
REBIND = "rebind.test"
BODY = json.dumps({"model": "policy", "messages": [{"role": "user", "content": "spend the backend's key"}]})

#: What a page tries, each request's outcome as the page sees it: "opaque" (a ``no-cors`` answer, unreadable),
#: "<status> <body>" when it can read the answer, or the error's name when the browser refused it.
ATTEMPTS = """async ({base, call, body}) => {
  const out = {};
  const attempt = async (name, send) => {
    try {
      const answer = await send();
      out[name] = answer.type === "opaque" ? "opaque" : `${answer.status} ${await answer.text()}`;
    } catch (error) {
      out[name] = error.name;
    }
  };
  await attempt("text/plain", () => fetch(base + call, {method: "POST", mode: "no-cors",
    headers: {"Content-Type": "text/plain; charset=json"}, body}));
  await attempt("no type", () => fetch(base + call, {method: "POST", mode: "no-cors", body: new Blob([body])}));
  await attempt("json", () => fetch(base + call, {method: "POST", headers: {"Content-Type": "application/json"},
    body}));
  await attempt("models", () => fetch(base + "/v1/models"));
  await attempt("pause", () => fetch(base + "/admin/v1/models/policy/pause", {method: "POST", mode: "no-cors"}));
  await attempt("agl", () => fetch(base + "/v1/agl/rollouts"));
  return out;
}"""


@dataclass
class Victim:
    """A running gateway serving ``policy`` on the mock backend, and a claimed rollout an agent is working on."""

    gateway: GatewayProcess
    token: str | None
    call: str  # the rollout's chat path, as its claim's base_url gives it

    @property
    def url(self) -> str:
        return self.gateway.url

    @property
    def port(self) -> int:
        port = urlsplit(self.url).port
        assert port is not None
        return port

    def admin(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def recorded(self) -> tuple[int, bool]:
        """(spans in the store, whether ``policy`` is paused)."""
        with self.admin() as admin:
            spans = admin.get("/admin/v1/stats").json()["total_spans"]
            paused = admin.get("/admin/v1/models/policy").json()["state"]["paused"]
        return spans, paused


class _Elsewhere(BaseHTTPRequestHandler):
    """Another site's page: an empty document at every path."""

    def do_GET(self) -> None:
        body = b"<!doctype html><title>elsewhere</title>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        return None


@pytest.fixture(scope="module")
def elsewhere() -> Iterator[str]:
    """The origin of another site's pages: a second server on loopback."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Elsewhere)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    driver: Playwright
    with sync_playwright() as driver:
        args = [*CHROMIUM_ARGS, f"--host-resolver-rules=MAP {REBIND} 127.0.0.1"]
        opened = driver.chromium.launch(executable_path=CHROMIUM, args=args)
        yield opened
        opened.close()


@pytest.fixture(scope="module", params=[TOKEN, None], ids=["admin token", "no admin token"])
def victim(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, mock_process: MockBackendProcess
) -> Iterator[Victim]:
    token: str | None = request.param
    folder = tmp_path_factory.mktemp("cross-site")
    with GatewayProcess(f"sqlite:///{folder / 'gateway.db'}", admin_token=token) as gateway:
        victim = Victim(gateway, token, "")
        with victim.admin() as admin:
            backend = {"base_url": mock_process.base_url, "kind": "vllm", "model": "mock-model"}
            admin.put("/admin/v1/models/policy", json={"backends": [backend]}).raise_for_status()
            admin.post("/admin/v1/rollouts", json={"tasks": [{"input": "a task"}]}).raise_for_status()
            [claim] = admin.post("/admin/v1/claims", json={"worker_id": "w"}).json()["claims"]
        victim.call = f"{urlsplit(claim['base_url']).path}/chat/completions"
        yield victim


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context()
    yield context.new_page()
    context.close()


def answered(page: Page) -> dict[Request, tuple[str, str, int | str]]:
    """Every request the page sends, in order: (method, path, the status of the answer Chromium received, readable
    by the page or not), or "failed" when Chromium had no answer it could give the page (no CORS headers)."""
    seen: dict[Request, tuple[str, str, int | str]] = {}

    def on_response(response: Response) -> None:
        seen.setdefault(response.request, (response.request.method, urlsplit(response.url).path, response.status))

    def on_failed(request: Request) -> None:
        seen.setdefault(request, (request.method, urlsplit(request.url).path, "failed"))

    page.on("response", on_response)
    page.on("requestfailed", on_failed)
    return seen


def test_a_page_of_another_origin_can_neither_make_a_call_nor_read_an_answer(
    victim: Victim, elsewhere: str, page: Page, mock: MockBackendProcess
) -> None:
    before = victim.recorded()
    seen = answered(page)
    page.goto(f"{elsewhere}/attack")
    # The last request's failure comes after every earlier request's events: once it is in, all of them are.
    with page.expect_event("requestfailed", lambda request: request.url.endswith("/v1/agl/rollouts")):
        outcome = page.evaluate(ATTEMPTS, {"base": victim.url, "call": victim.call, "body": BODY})
    # Posts the browser sends without asking: sent, their answers unreadable; the rest refused by the browser,
    # since Rollway answers neither a preflight nor with CORS headers.
    assert outcome == {
        "text/plain": "opaque",
        "no type": "opaque",
        "json": "TypeError",
        "models": "TypeError",
        "pause": "opaque",
        "agl": "TypeError",
    }
    # The posts reached Rollway, which refused them (403) before any route ran; the reads were sent too, and
    # their answers (Rollway's 403, as the fast tests check) withheld from the page.
    assert list(seen.values()) == [
        ("GET", "/attack", 200),
        ("POST", victim.call, 403),  # text/plain
        ("POST", victim.call, 403),  # no type
        ("POST", victim.call, "failed"),  # its preflight refused (403): never sent
        ("GET", "/v1/models", "failed"),
        ("POST", "/admin/v1/models/policy/pause", 403),
        ("GET", "/v1/agl/rollouts", "failed"),
    ]
    assert victim.recorded() == before
    assert mock.stats()["requests_total"] == 0

    # From Rollway's own origin (its dashboard's) the call is made and recorded, and a text/plain body is still
    # refused, by the data plane itself, before the backend hears of it.
    page.goto(f"{victim.url}/healthz")
    own = page.evaluate(
        """async ({call, body}) => {
          const json = await fetch(call, {method: "POST", headers: {"Content-Type": "application/json"}, body});
          const plain = await fetch(call, {method: "POST", headers: {"Content-Type": "text/plain"}, body});
          return [json.status, (await json.json()).object, plain.status, (await plain.json()).error.type];
        }""",
        {"call": victim.call, "body": BODY},
    )
    assert own == [200, "chat.completion", 415, "invalid_request_error"]
    assert mock.stats()["requests_total"] == 1  # the json call alone
    assert victim.recorded() == (before[0] + 1, False)


def test_a_dns_rebinding_page_cannot_read_an_answer_or_make_a_call(
    victim: Victim, page: Page, mock: MockBackendProcess
) -> None:
    """The page's origin is its own name at Rollway's address: same-origin to the browser, which lets it read
    whatever comes back. Rollway refuses the name (``Host``), so all it can read is that refusal."""
    before = victim.recorded()
    rebound = f"http://{REBIND}:{victim.port}"
    landing = page.goto(f"{rebound}/v1/models")
    assert landing is not None and landing.status == 403
    read = page.evaluate(
        """async ({call, body}) => {
          const out = [];
          for (const [path, init] of [
            ["/v1/models", {}],
            [call, {method: "POST", headers: {"Content-Type": "application/json"}, body}],
            ["/admin/v1/rollouts", {}],
          ]) {
            const answer = await fetch(path, init);
            out.push([answer.status, (await answer.json()).error.type]);
          }
          return out;
        }""",
        {"call": victim.call, "body": BODY},
    )
    assert read == [[403, "permission_error"]] * 3
    assert victim.recorded() == before
    assert mock.stats()["requests_total"] == 0

    # At Rollway's own address the same script reads the answer.
    page.goto(f"{victim.url}/healthz")
    listed = page.evaluate("async () => (await (await fetch('/v1/models')).json()).data.map(m => m.id)")
    assert listed == ["policy"]
