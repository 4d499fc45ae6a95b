"""The dashboard in a real headless Chromium against ``rollway serve`` in a subprocess, drawing spans whose
attributes do not have the types the gateway writes. Agents' tracers and OTLP exporters write spans too (the
admin spans route, ``/v1/traces``), with any type: every value the pages read is shown as it was recorded and
marked ``.malformed``, and no page throws (each test fails on any console error or uncaught exception)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollway.process import GatewayProcess
from support.ui_env import Watched, launch, require_browser, watched_page

require_browser()

from playwright.sync_api import Browser, Page, expect, sync_playwright  # noqa: E402

pytestmark = [pytest.mark.real_component]

#: A chat call as the gateway records it, but for the attributes each test breaks.
CALL: dict[str, Any] = {
    "gen_ai.operation.name": "chat",
    "gen_ai.request.model": "policy",
    "gen_ai.usage.input_tokens": 5,
    "gen_ai.usage.output_tokens": 3,
    "rollway.model_version": "v1",
    "rollway.latency_seconds": 0.25,
    "rollway.request": {"messages": [{"role": "user", "content": "hi"}]},
    "rollway.response": {"choices": [{"index": 0, "message": {"role": "assistant", "content": "a b c"}}]},
    "rollway.response_token_ids": [11, 12, 13],
    "rollway.response_logprobs": [-0.1, -0.2, -0.3],
}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """A gateway without an admin token (loopback only), with no backend: the spans are written to it."""
    folder = tmp_path_factory.mktemp("malformed")
    with GatewayProcess(f"sqlite:///{Path(folder) / 'ui.db'}") as process:
        yield process


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as driver:
        opened = launch(driver)
        yield opened
        opened.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Watched]:
    with watched_page(browser) as watched:
        yield watched


def rollout_with(gateway: GatewayProcess, *spans: dict[str, Any]) -> str:
    """A started rollout holding ``spans`` (name and attributes each), written through the admin API."""
    with httpx.Client(base_url=f"{gateway.url}/admin/v1", timeout=30) as admin:
        started = admin.post("/rollouts/start", json={"input": "q", "worker_id": "w"})
        rollout_id: str = started.json()["rollout"]["rollout_id"]
        written = admin.post(f"/rollouts/{rollout_id}/spans", json={"spans": list(spans)})
        assert written.status_code == 201, written.text
    return rollout_id


def opened(page: Page, gateway: GatewayProcess, rollout_id: str) -> None:
    page.goto(f"{gateway.url}/ui/rollouts/{rollout_id}")
    page.locator("main[data-loaded]").wait_for()


def test_logprobs_and_token_ids_of_the_wrong_type_are_shown_as_text_and_marked(
    gateway: GatewayProcess, page: Watched
) -> None:
    """Strings among a call's logprobs (``lp.toFixed`` is not a function of a string) do not take the token view
    down: a token id that is not an integer, and a logprob that is not a number, are shown as recorded."""
    bad = {**CALL, "rollway.response_token_ids": [11, "twelve", 13], "rollway.response_logprobs": [-0.1, "-0.2", None]}
    rollout_id = rollout_with(gateway, {"name": "chat policy", "attributes": bad})
    opened(page.page, gateway, rollout_id)
    card = page.page.locator("#call-1")
    card.locator(".show-tokens").click()
    tokens = card.locator(".tok")
    expect(tokens).to_have_count(3)
    assert tokens.evaluate_all("ts => ts.map(t => t.dataset.id)") == ["11", "twelve", "13"]
    assert tokens.evaluate_all("ts => ts.map(t => t.classList.contains('malformed'))") == [False, True, False]
    expect(tokens.nth(0)).to_have_attribute("title", "#0 id 11 · logprob -0.1000 · p 0.905")
    expect(tokens.nth(1)).to_have_attribute("title", '#1 id "twelve" (not an integer) · logprob "-0.2" (not a number)')
    expect(tokens.nth(1)).to_have_attribute("data-logprob", "-0.2")
    expect(tokens.nth(2)).to_have_attribute("title", "#2 id 13")  # null: no logprob, not a wrong one
    expect(card.locator(".token-legend .swatch.malformed")).to_have_text("marked")
    assert page.problems() == []


def test_lists_that_are_not_lists_and_numbers_that_are_not_numbers_are_marked(
    gateway: GatewayProcess, page: Watched
) -> None:
    no_ids = {
        **CALL,
        "rollway.response_token_ids": "11,12,13",
        "gen_ai.usage.input_tokens": {"prompt": 5},
        "gen_ai.usage.output_tokens": "3",
        "rollway.latency_seconds": "fast",
        "rollway.model_version": ["v", 1],
    }
    no_logprobs = {**CALL, "rollway.response_logprobs": "-0.1 -0.2 -0.3"}
    rollout_id = rollout_with(
        gateway,
        {"name": "chat policy", "attributes": no_ids},
        {"name": "chat policy", "attributes": no_logprobs},
        {"name": "rollway.reward", "attributes": {"rollway.reward.value": "high", "rollway.reward.name": 7}},
    )
    opened(page.page, gateway, rollout_id)
    first = page.page.locator("#call-1")
    expect(first.locator(".token-ids .malformed")).to_have_text("11,12,13")
    expect(first.locator(".usage .malformed")).to_have_text(['{"prompt":5}', "3"])
    expect(first.locator(".latency .malformed")).to_have_text("fast")
    expect(first.locator(".version .malformed")).to_have_text('["v",1]')
    second = page.page.locator("#call-2")
    second.scroll_into_view_if_needed()
    second.locator(".show-tokens").click()
    expect(second.locator(".token-legend .malformed")).to_have_text("-0.1 -0.2 -0.3")
    uncoloured = "ts => ts.map(t => [...t.classList].some(c => /^p[0-9]$/.test(c)))"
    assert second.locator(".tok").evaluate_all(uncoloured) == [False] * 3
    reward = page.page.locator("#rewards-table tr.reward")
    expect(reward.locator(".reward-value .malformed")).to_have_text("high")
    expect(reward.locator("td").first.locator(".malformed")).to_have_text("7")
    expect(page.page.locator("#call-2 .reward-badge .malformed")).to_have_text("high")
    assert page.problems() == []


def test_a_request_and_an_answer_of_the_wrong_shape_are_drawn_with_their_odd_parts_marked(
    gateway: GatewayProcess, page: Watched
) -> None:
    """Messages, choices and tool calls that are not objects, and fields of them that are not text, once made the
    call's body throw (``null.role``, ``null.function``) and left the rest of the page undrawn."""
    tool_calls = [None, {"id": "c1", "function": {"name": 5, "arguments": {"x": 1}}}]
    odd = {
        **CALL,
        "rollway.request": {"messages": [None, {"role": "user", "content": "hi", "name": {"first": "a"}}, 5]},
        "rollway.response": {
            "choices": [
                None,
                {"message": {"content": "ok", "tool_calls": tool_calls}},
                {"message": "not an object", "finish_reason": ["stop"]},
            ]
        },
        "rollway.response_token_ids": [11, 12],
        "rollway.response_logprobs": [-0.1, -0.2],
    }
    output = [None, {"type": "message", "content": "hi"}]
    odd_output = {**CALL, "rollway.request": "just text", "rollway.response": {"output": output}}
    rollout_id = rollout_with(
        gateway, {"name": "chat policy", "attributes": odd}, {"name": "chat policy", "attributes": odd_output}
    )
    opened(page.page, gateway, rollout_id)
    first = page.page.locator("#call-1")
    expect(first.locator(".chat .msg")).to_have_count(3)
    expect(first.locator(".chat .msg > .malformed")).to_have_text(["null", "5"])
    expect(first.locator(".chat .role .malformed")).to_have_text('{"first":"a"}')
    choices = first.locator(".response .choice")
    expect(choices).to_have_count(3)
    expect(choices.nth(0).locator(".malformed")).to_have_text("null")
    expect(choices.nth(1).locator(".response-text")).to_have_text("ok")
    expect(choices.nth(1).locator(".tool-calls li")).to_have_count(2)
    expect(choices.nth(1).locator(".tool-calls li").nth(0).locator(".malformed")).to_have_text("null")
    expect(choices.nth(1).locator(".tool-calls li code .malformed")).to_have_text(["5", '{"x":1}'])
    expect(choices.nth(2).locator(".response-text .malformed")).to_have_text("not an object")
    expect(choices.nth(2).locator(".muted .malformed")).to_have_text('["stop"]')
    second = page.page.locator("#call-2")
    second.scroll_into_view_if_needed()
    expect(second.locator(".columns .malformed").first).to_have_text("just text")
    expect(second.locator(".response .malformed")).to_have_text("null")
    expect(second.locator(".response .response-text").nth(1)).to_have_text("hi")
    assert page.problems() == []
