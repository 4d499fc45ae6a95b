"""A dspy group with dspy's cache on (its default), seen on its group page in a real headless Chromium: the four
members claim through the admin API and call ``rollway serve`` (a subprocess, in front of the mock backend)
through dspy, each with its own rollout key; dspy's cache answers three of them, so the page flags the group as
degenerate and names the members that made no LLM call, as ``GET /admin/v1/groups/{id}`` does."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from rollway import RollwayClient
from rollway.mock import MockBackendProcess
from rollway.process import GatewayProcess
from support.dspy_group import ask_all
from support.gateway_harness import vllm
from support.ui_env import launch, require_browser, watched_page

require_browser()

from playwright.sync_api import expect, sync_playwright  # noqa: E402

pytestmark = [pytest.mark.real_component, pytest.mark.slow]


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[GatewayProcess]:
    with GatewayProcess(f"sqlite:///{tmp_path / 'groups.db'}") as process:
        yield process


def test_a_dspy_group_with_its_cache_on_is_flagged_on_its_page(
    gateway: GatewayProcess, mock: MockBackendProcess
) -> None:
    with RollwayClient(gateway.url) as client:
        client.put_model("policy", [vllm(mock)])
        client.enqueue([{"input": {"q": "2+2"}, "group_id": "g-dspy", "group_size": 4}])
        claims = client.claim("dspy-runner", limit=4)
        assert len(claims) == 4
        ask_all(f"{gateway.url}/v1", [claim.api_key for claim in claims], cache=True)
        for claim in claims:
            client.update_attempt(claim.rollout.rollout_id, claim.attempt.attempt_id, status="succeeded", reward=1.0)
        group = client.get_group("g-dspy")
    assert group.complete and group.health.degenerate
    without = group.health.without_calls
    assert len(without) == 3  # the cache answered every member after the first

    with sync_playwright() as driver:
        browser = launch(driver)
        try:
            with watched_page(browser) as page:
                page.page.goto(f"{gateway.url}/ui/groups/g-dspy")
                page.page.locator("main[data-loaded]").wait_for()
                flag = page.page.locator("#group-health")
                expect(flag).to_contain_text("Degenerate group.")
                expect(flag).to_contain_text("3 finished members made no LLM call")
                for rollout_id in without:
                    expect(flag).to_contain_text(rollout_id)
                expect(flag).to_contain_text("dspy's cache is on by default")
                assert page.problems() == []
        finally:
            browser.close()
