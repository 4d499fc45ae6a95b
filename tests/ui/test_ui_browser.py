"""The dashboard (``/ui``) in a real headless Chromium, against ``rollway serve`` in a subprocess filled by
``rollway demo``'s own loop. What each page shows is compared with what the admin API answers for the same
thing; every test also fails on any console error or uncaught exception in the page.

With ``ROLLWAY_UI_SCREENSHOTS=DIR`` the tests save the screenshots ``docs/dashboard.md`` shows into ``DIR``.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from support.ui_env import Filled, Watched, filled_gateway, launch, require_browser, watched_page

require_browser()

from playwright.sync_api import Browser, Page, Playwright, expect, sync_playwright  # noqa: E402

pytestmark = [pytest.mark.real_component, pytest.mark.slow]
REWARD = "rollway.reward"
LIVE = 5  # seconds between the rollout page's refreshes while the rollout is in progress (rollout.js, LIVE)
SHOTS = os.environ.get("ROLLWAY_UI_SCREENSHOTS")


@pytest.fixture(scope="module")
def playwright() -> Iterator[Playwright]:
    with sync_playwright() as driver:
        yield driver


@pytest.fixture(scope="module")
def browser(playwright: Playwright) -> Iterator[Browser]:
    opened = launch(playwright)
    yield opened
    opened.close()


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Filled]:
    """A gateway without an admin token (loopback), filled by the demo loop."""
    with filled_gateway(tmp_path_factory.mktemp("ui")) as filled:
        yield filled


@pytest.fixture
def page(browser: Browser) -> Iterator[Watched]:
    with watched_page(browser) as watched:
        yield watched


def shot(page: Page, name: str) -> None:
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(SHOTS) / f"{name}.png"), full_page=True)


def loaded(page: Page) -> None:
    """Wait until the page has drawn its data (each page marks <main data-loaded> once it has)."""
    page.locator("main[data-loaded]").wait_for()


def call_spans(admin: httpx.Client, rollout_id: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(LLM call spans, reward spans) of the rollout's latest attempt, in sequence order."""
    spans = admin.get(f"/admin/v1/rollouts/{rollout_id}/spans").json()["items"]
    calls = [s for s in spans if s["name"] != REWARD]
    return calls, [s for s in spans if s["name"] == REWARD]


def test_a_rollout_page_shows_its_calls_in_order_with_text_token_ids_and_reward(demo: Filled, page: Watched) -> None:
    rollout_id = demo.rollout_ids[1]
    with demo.admin() as admin:
        calls, rewards = call_spans(admin, rollout_id)
    assert len(calls) >= 2 and len(rewards) == 1

    page.page.goto(f"{demo.url}/ui/rollouts/{rollout_id}")
    loaded(page.page)
    cards = page.page.locator("article.call")
    assert cards.evaluate_all("cards => cards.map(c => Number(c.dataset.sequence))") == [
        c["sequence_id"] for c in calls
    ]
    for span in calls:
        card = page.page.locator(f"#call-{span['sequence_id']}")
        card.scroll_into_view_if_needed()
        text = span["attributes"]["rollway.response"]["choices"][0]["message"]["content"]
        expect(card.locator(".response-text")).to_have_text(text)
        expect(card.locator(".version")).to_contain_text(span["attributes"]["rollway.model_version"])
        card.locator(".show-tokens").click()
        tokens = card.locator(".tok")
        ids = span["attributes"]["rollway.response_token_ids"]
        assert tokens.evaluate_all("ts => ts.map(t => Number(t.dataset.id))") == ids
        tokens.nth(1).hover()
        expect(tokens.nth(1)).to_have_attribute("title", re.compile(rf"id {ids[1]} · logprob "))
        card.locator(".show-ids").check()  # every token as its id, visible
        expect(tokens.nth(0).locator(".i")).to_be_visible()
        expect(tokens.nth(0).locator(".i")).to_have_text(str(ids[0]))
        # Each id on one line, however the view wraps; the colours explained beside them.
        assert tokens.evaluate_all("ts => ts.filter(t => t.getClientRects().length !== 1).length") == 0
        expect(card.locator(".token-legend .swatch.p9")).to_have_text("≥ 0.9")
    value = rewards[0]["attributes"]["rollway.reward.value"]
    expect(page.page.locator("#rewards-table .reward-value")).to_have_text([f"{value:g}"])
    last_call = calls[-1]["sequence_id"]
    expect(page.page.locator(f"#call-{last_call} .reward-badge")).to_have_text(f"reward {value:g}")
    expect(page.page.locator("#triplets-table tbody tr")).to_have_count(len(calls))
    page.page.locator(".show-sequence").first.click()
    expect(page.page.locator(".merged-row .tok.trained").first).to_be_visible()
    expect(page.page.locator(".merged-row .token-legend").first).to_contain_text("loss mask 1")
    shot(page.page, "rollout")
    assert page.problems() == []


def test_the_timeline_marks_each_call_of_the_attempt_at_its_start(demo: Filled, page: Watched) -> None:
    rollout_id = demo.rollout_ids[2]
    with demo.admin() as admin:
        calls, _ = call_spans(admin, rollout_id)
        rollout = admin.get(f"/admin/v1/rollouts/{rollout_id}").json()
    assert len(calls) >= 2 and len(rollout["attempts"]) == 1

    page.page.goto(f"{demo.url}/ui/rollouts/{rollout_id}")
    loaded(page.page)
    expect(page.page.locator("#live-bar")).to_have_count(0)  # finished: nothing to follow
    # <main> holds elements only, no stray text (a "null" where a part is left out).
    stray = "() => [...document.querySelector('main').childNodes].filter(n => n.nodeType === 3).map(n => n.data)"
    assert page.page.evaluate(stray) == []
    ticks = page.page.locator("svg.timeline .tick")
    expect(ticks).to_have_count(len(calls))
    drawn = ticks.evaluate_all(
        "ts => ts.map(t => [Number(t.dataset.sequence), t.x.baseVal.value + t.width.baseVal.value / 2,"
        " t.y.baseVal.value, t.querySelector('title').textContent])"
    )
    assert [seq for seq, *_ in drawn] == [c["sequence_id"] for c in calls]
    for (seq, _, _, title), span in zip(drawn, calls, strict=True):
        assert title.startswith(f"#{seq} · {span['attributes']['gen_ai.request.model']} · ")
    # Each tick is at its call's start on the attempt's row; the rollout's bar gives the time axis's scale.
    bars = page.page.locator("svg.timeline rect.bar")
    left, width = (float(bars.first.get_attribute(name) or "nan") for name in ("x", "width"))
    row = float(bars.nth(1).get_attribute("y") or "nan")  # the attempt's bar
    start, end = rollout["start_time"], rollout["end_time"]
    for (_, x, y, _), span in zip(drawn, calls, strict=True):
        assert x == pytest.approx(left + (span["start_time"] - start) / (end - start) * width, abs=0.2)
        assert abs(y - row) < 10
    last = calls[-1]["sequence_id"]
    ticks.last.click()
    expect(page.page.locator(f"#call-{last}")).to_be_in_viewport()
    expect(page.page.locator(f"#call-{last}")).to_have_class(re.compile(r"\bpicked\b"))
    assert page.problems() == []


def test_a_group_page_shows_its_members_and_their_rewards(demo: Filled, page: Watched) -> None:
    with demo.admin() as admin:
        group_id = admin.get(f"/admin/v1/rollouts/{demo.rollout_ids[0]}").json()["group_id"]
        group = admin.get(f"/admin/v1/groups/{group_id}").json()
        expected = {}
        for member in group["rollouts"]:
            [reward] = call_spans(admin, member["rollout_id"])[1]
            expected[member["rollout_id"]] = f"{reward['attributes']['rollway.reward.value']:g}"
    page.page.goto(f"{demo.url}/ui/groups/{group_id}")
    loaded(page.page)
    rows = page.page.locator("#members-table tr.member")
    shown = rows.evaluate_all(
        "rows => rows.map(r => [r.dataset.rolloutId, r.querySelector('.reward-value').textContent])"
    )
    assert dict(shown) == expected
    assert [r for r, _ in shown] == [m["rollout_id"] for m in group["rollouts"]]  # group order
    expect(page.page.locator("h1 .badge")).to_have_text("complete" if group["complete"] else "incomplete")
    expect(page.page.locator("#reward-spread")).to_contain_text(f"over {len(expected)} members")
    # The group's health as the API gives it: the mock answers a question alike every time, so a group whose
    # members asked the same questions is flagged as giving every member the same answers.
    if group["health"]["degenerate"]:
        expect(page.page.locator("#group-health")).to_contain_text("Degenerate group.")
    else:
        expect(page.page.locator("#group-health")).to_have_count(0)
    shot(page.page, "group")
    assert page.problems() == []


def test_the_overview_counts_rollouts_by_status_as_the_store_does(demo: Filled, page: Watched) -> None:
    with demo.admin() as admin:
        stats = admin.get("/admin/v1/stats").json()
    page.page.goto(f"{demo.url}/ui")
    loaded(page.page)
    shown = page.page.locator("#status-counts a.tile").evaluate_all(
        "tiles => tiles.map(t => [t.dataset.status, Number(t.querySelector('.count').textContent.replace(/,/g, ''))])"
    )
    assert dict(shown) == stats["rollouts_by_status"]
    assert sum(stats["rollouts_by_status"].values()) >= len(demo.rollout_ids) > 0
    expect(page.page.locator("#queue-depth .count")).to_have_text(str(stats["queue_depth"]))
    expect(page.page.locator("figure.chart-box")).to_have_count(5)
    calls = page.page.locator("figure[data-chart='calls/s']")
    expect(calls.locator("path.line, circle")).not_to_have_count(0)  # the demo's calls are drawn
    rewards = page.page.locator("figure[data-chart^='reward']")
    expect(rewards.locator("path.line, circle")).not_to_have_count(0)  # and its rewards
    expect(page.page.locator("#models-table tr[data-alias='policy']")).to_contain_text("active")
    expect(page.page.locator("#models-table tr[data-alias='policy'] [data-health]").first).to_have_text("up")
    shot(page.page, "overview")
    assert page.problems() == []


def test_the_rollouts_page_filters_pages_by_cursor_and_finds_an_id(demo: Filled, page: Watched) -> None:
    with demo.admin() as admin:
        everything = admin.get("/admin/v1/rollouts", params={"limit": 1000, "order": "desc"}).json()["items"]
        oldest = [r["rollout_id"] for r in admin.get("/admin/v1/rollouts", params={"limit": 1000}).json()["items"]]
    ids = [r["rollout_id"] for r in everything]  # newest first, the page's order unless asked otherwise
    assert ids == oldest[::-1] and len(ids) > 10
    page.page.goto(f"{demo.url}/ui/rollouts?limit=5")
    loaded(page.page)
    rows = page.page.locator("#rollouts-table tbody tr")

    def shown() -> list[str]:
        found: list[str] = rows.evaluate_all("rows => rows.map(r => r.dataset.rolloutId)")
        return found

    expect(rows).to_have_count(5)
    assert shown() == ids[:5]
    # Each rollout's primary reward beside it, as the API lists it ("—": none yet).
    assert any(r["reward"] is not None for r in everything)
    cells = rows.locator("td.reward").evaluate_all("cells => cells.map(c => c.textContent)")
    assert cells == ["—" if r["reward"] is None else f"{r['reward']:g}" for r in everything[:5]]
    shot(page.page, "rollouts")
    page.page.get_by_role("link", name="next →").click()
    loaded(page.page)
    expect(rows.first).to_have_attribute("data-rollout-id", ids[5])
    assert shown() == ids[5:10]
    assert "cursor=" in page.page.url  # the page is a URL of its own
    page.page.get_by_role("link", name="← previous").click()
    expect(rows.first).to_have_attribute("data-rollout-id", ids[0])
    assert shown() == ids[:5]

    page.page.select_option("#rollout-filters select[name=order]", "asc")
    page.page.click("#rollout-filters button[type=submit]")
    expect(rows.first).to_have_attribute("data-rollout-id", oldest[0])
    assert shown() == oldest[:5]
    assert "order=asc" in page.page.url
    page.page.get_by_role("link", name="next →").click()
    expect(rows.first).to_have_attribute("data-rollout-id", oldest[5])
    assert shown() == oldest[5:10]
    page.page.select_option("#rollout-filters select[name=order]", "desc")
    page.page.click("#rollout-filters button[type=submit]")
    expect(rows.first).to_have_attribute("data-rollout-id", ids[0])
    assert shown() == ids[:5]
    assert "order=" not in page.page.url and "cursor=" not in page.page.url  # the default; a new order starts over

    # The newest group: other tests add rollouts of no group, which may be newer.
    group_id = next(r["group_id"] for r in everything if r["group_id"])
    page.page.fill("#rollout-filters input[name=group]", group_id)
    page.page.select_option("#rollout-filters select[name=status]", "succeeded")
    page.page.click("#rollout-filters button[type=submit]")
    loaded(page.page)
    members = [r["rollout_id"] for r in everything if r["group_id"] == group_id and r["status"] == "succeeded"]
    expect(rows).to_have_count(len(members))
    assert shown() == members
    assert f"group={group_id}" in page.page.url

    page.page.fill("#rollout-filters input[name=model]", "policy")  # the demo's rollouts all called it
    page.page.click("#rollout-filters button[type=submit]")
    loaded(page.page)
    expect(rows).to_have_count(len(members))
    assert "model=policy" in page.page.url
    page.page.fill("#rollout-filters input[name=model]", "no-such-alias")
    page.page.click("#rollout-filters button[type=submit]")
    expect(page.page.locator("#no-rollouts")).to_be_visible()
    page.page.fill("#rollout-filters input[name=model]", "")
    page.page.select_option("#rollout-filters select[name=status]", "failed")
    page.page.click("#rollout-filters button[type=submit]")
    expect(page.page.locator("#no-rollouts")).to_be_visible()

    page.page.fill("#rollout-search input[name=id]", ids[3])
    page.page.click("#rollout-search button[type=submit]")
    expect(page.page.locator("#rollout-id")).to_have_text(ids[3])
    assert page.page.url.endswith(f"/ui/rollouts/{ids[3]}")
    page.page.go_back()
    expect(page.page.locator("#rollout-filters")).to_be_visible()
    assert page.problems() == []


def test_pausing_and_resuming_a_model_from_its_page_changes_its_state(demo: Filled, page: Watched) -> None:
    def paused() -> bool:
        with demo.admin() as admin:
            [model] = [m for m in admin.get("/admin/v1/models").json()["items"] if m["alias"] == "policy"]
        return bool(model["state"]["paused"])

    page.page.goto(f"{demo.url}/ui/models/policy")
    loaded(page.page)
    assert paused() is False
    page.page.click("#pause")
    expect(page.page.locator("#confirm-dialog")).to_be_visible()
    page.page.click("#confirm-cancel")  # a cancelled confirmation does nothing
    expect(page.page.locator("#confirm-dialog")).to_be_hidden()
    assert paused() is False

    page.page.click("#pause")
    page.page.click("#confirm-ok")
    expect(page.page.locator("#model-state")).to_have_attribute("data-paused", "true")
    assert paused() is True
    shot(page.page, "model")
    page.page.click("#resume")
    page.page.click("#confirm-ok")
    expect(page.page.locator("#model-state")).to_have_attribute("data-paused", "false")
    assert paused() is False
    assert page.problems() == []


def test_a_swap_from_the_model_page_installs_the_new_version(demo: Filled, page: Watched) -> None:
    with demo.admin() as admin:
        before = admin.get("/admin/v1/models/policy").json()["version"]
    page.page.goto(f"{demo.url}/ui/models/policy")
    loaded(page.page)
    page.page.fill("#swap-form input[name=version]", "demo-v2")
    page.page.click("#swap-form button[type=submit]")
    expect(page.page.locator("#confirm-text")).to_contain_text("demo-v2")
    page.page.click("#confirm-ok")
    expect(page.page.locator("#model-version")).to_have_text("demo-v2")
    with demo.admin() as admin:
        assert admin.get("/admin/v1/models/policy").json()["version"] == "demo-v2"
        admin.post("/admin/v1/models/policy/swap", json={"version": before}).raise_for_status()
    assert page.problems() == []


def test_a_call_without_a_logprob_for_every_token_is_flagged(demo: Filled, page: Watched) -> None:
    """A trainable call whose logprobs do not cover its output (``rollway.logprobs_complete`` false, as the gateway
    records a call the engine answered with ids and too few logprobs) has a "no logprobs" badge; a complete one
    has none."""
    call = {
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": "policy",
        "rollway.request": {"messages": [{"role": "user", "content": "hi"}]},
        "rollway.response": {"choices": [{"index": 0, "message": {"role": "assistant", "content": "a b c"}}]},
        "rollway.prompt_token_ids": [1, 2],
        "rollway.response_token_ids": [11, 12, 13],
        "rollway.trainable": True,
    }
    complete = {"rollway.response_logprobs": [-0.1, -0.2, -0.3], "rollway.logprobs_complete": True}
    incomplete = {"rollway.response_logprobs": None, "rollway.logprobs_complete": False}
    spans = [
        {"name": "chat policy", "attributes": call | complete},
        {"name": "chat policy", "attributes": call | incomplete},
    ]
    with demo.admin() as admin:
        started = admin.post("/admin/v1/rollouts/start", json={"input": "q", "worker_id": "ui-logprobs"})
        rollout_id = started.json()["rollout"]["rollout_id"]
        admin.post(f"/admin/v1/rollouts/{rollout_id}/spans", json={"spans": spans}).raise_for_status()
    page.page.goto(f"{demo.url}/ui/rollouts/{rollout_id}")
    loaded(page.page)
    expect(page.page.locator("#call-2 .no-logprobs")).to_have_text("no logprobs")
    expect(page.page.locator("#call-1 .no-logprobs")).to_have_count(0)
    assert page.problems() == []


def test_a_dead_backend_shows_as_down(demo: Filled, page: Watched) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # released: nothing listens there
    dead = {"backend_id": "dead", "base_url": f"http://127.0.0.1:{port}/v1", "kind": "vllm", "model": "m"}
    with demo.admin() as admin:
        admin.put("/admin/v1/models/ui-dead", json={"backends": [dead]}).raise_for_status()
    try:
        page.page.goto(f"{demo.url}/ui/models/ui-dead")
        loaded(page.page)
        expect(page.page.locator("tr[data-backend-id='dead'] [data-health]")).to_have_text("down")
        assert page.problems() == []
    finally:
        with demo.admin() as admin:
            admin.delete("/admin/v1/models/ui-dead").raise_for_status()


def test_the_model_page_lists_its_weight_updates(demo: Filled, page: Watched) -> None:
    with demo.admin() as admin:
        before = admin.get("/admin/v1/models/policy").json()["version"]
        update = admin.post("/admin/v1/models/policy/updates", json={"version": "ui-w1", "note": "from the test"})
        assert update.status_code == 200, update.text
    page.page.goto(f"{demo.url}/ui/models/policy")
    loaded(page.page)
    row = page.page.locator(f"#updates-table tr[data-update-id='{update.json()['update_id']}']")
    expect(row).to_contain_text(f"{before} → ui-w1")
    expect(row).to_contain_text("committed")
    expect(row).to_contain_text("from the test")
    expect(page.page.locator("#model-version")).to_have_text("ui-w1")
    # The engine reports the version the update gave it (checked again as the update ended).
    engine = page.page.locator("#backends-table td.engine-version span").first
    expect(engine).to_have_attribute("data-state", "match")
    expect(engine).to_have_text("ui-w1")
    shot(page.page, "model-updates")
    with demo.admin() as admin:
        admin.post("/admin/v1/models/policy/swap", json={"version": before}).raise_for_status()
    assert page.problems() == []


def test_the_page_of_a_rollout_in_progress_follows_it_until_it_finishes(demo: Filled, page: Watched) -> None:
    from openai import OpenAI

    with demo.admin() as admin:
        claim = admin.post("/admin/v1/rollouts/start", json={"worker_id": "ui-test"}).json()
    rollout_id, attempt_id = claim["rollout"]["rollout_id"], claim["attempt"]["attempt_id"]
    ask: dict[str, Any] = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    p = page.page
    p.set_viewport_size({"width": 1280, "height": 480})  # short, so that the page scrolls
    cards = p.locator("#calls article.call")
    with OpenAI(base_url=claim["base_url"], api_key=claim["api_key"], max_retries=0) as llm:
        reply = llm.chat.completions.create(**ask).choices[0].message.content or ""
        p.goto(f"{demo.url}/ui/rollouts/{rollout_id}")
        loaded(p)
        expect(p.locator("#live")).to_be_checked()
        expect(cards).to_have_count(1)
        first = p.locator("#call-1")
        first.locator(".show-tokens").click()  # the user opens the first call's tokens
        expect(first.locator(".tok").first).to_be_visible()
        p.locator("details summary").click()  # and the rollout's input
        first.evaluate("card => { card.dataset.kept = 'yes' }")  # a card drawn again would not carry this
        first.evaluate("card => card.scrollIntoView()")
        scrolled = p.evaluate("() => window.scrollY")
        assert scrolled > 0

        ask["messages"] += [{"role": "assistant", "content": reply}, {"role": "user", "content": "and then?"}]
        answer = llm.chat.completions.create(**ask)  # the page learns of it only by refreshing

    second = p.locator("#call-2")
    expect(second).to_be_attached(timeout=4 * LIVE * 1000)
    with demo.admin() as admin:
        calls, _ = call_spans(admin, rollout_id)
    assert cards.evaluate_all("cards => cards.map(c => Number(c.dataset.sequence))") == [1, 2]
    assert [c["sequence_id"] for c in calls] == [1, 2]
    expect(p.locator("#calls-progress")).to_have_text("2 calls")
    expect(p.locator("svg.timeline .tick")).to_have_count(2)
    assert p.evaluate("() => window.scrollY") == scrolled  # the new call came in below; the view did not move
    expect(first.locator(".tok").first).to_be_visible()  # still open: the first card was left as it was
    expect(first).to_have_attribute("data-kept", "yes")
    expect(p.locator("details")).to_have_attribute("open", "")
    second.scroll_into_view_if_needed()
    expect(second.locator(".response-text")).to_have_text(answer.choices[0].message.content or "")

    with demo.admin() as admin:
        admin.post(f"/admin/v1/rollouts/{rollout_id}/rewards", json={"value": 1.0}).raise_for_status()
        path = f"/admin/v1/rollouts/{rollout_id}/attempts/{attempt_id}"
        admin.patch(path, json={"status": "succeeded"}).raise_for_status()
        assert admin.get(f"/admin/v1/rollouts/{rollout_id}").json()["status"] == "succeeded"
        triplets = admin.get("/admin/v1/triplets", params={"rollout_id": rollout_id, "partial": True}).json()
    expect(p.locator("h1 .badge")).to_have_text("succeeded", timeout=4 * LIVE * 1000)
    expect(p.locator("#attempts-table .badge")).to_have_text("succeeded")
    expect(p.locator("#rollout-ended")).not_to_have_text("—")
    expect(p.locator("#call-2 .reward-badge")).to_have_text("reward 1")
    expect(p.locator("#rewards-table .reward-value")).to_have_text(["1"])
    assert len(triplets["items"]) == 2
    rows = p.locator("#triplets-table tbody tr")  # the training view, drawn now that the rollout has finished
    expect(rows).to_have_count(len(triplets["items"]))
    expect(first).to_have_attribute("data-kept", "yes")

    def admin_requests() -> list[str]:
        return [u for u in page.urls if "/admin/v1/" in u]

    before = len(admin_requests())
    assert [u for u in admin_requests() if u.endswith(f"/rollouts/{rollout_id}")]  # it did poll the rollout
    p.wait_for_timeout((LIVE + 2) * 1000)  # longer than a refresh's interval: one would be seen here
    assert admin_requests()[before:] == []
    expect(p.locator("#refreshed")).to_have_text("finished: no more updates")
    expect(p.locator("#live")).not_to_be_checked()
    p.locator("#rewards-table a").click()  # an anchor in the page (#call-2): the page stays as it is
    expect(second).to_be_in_viewport()
    expect(first).to_have_attribute("data-kept", "yes")
    assert page.problems() == []


def test_a_span_written_after_a_later_one_is_shown_in_its_place(demo: Filled, page: Watched) -> None:
    with demo.admin() as admin:
        claim = admin.post("/admin/v1/rollouts/start", json={"worker_id": "ui-test"}).json()
    rollout_id, attempt_id = claim["rollout"]["rollout_id"], claim["attempt"]["attempt_id"]

    def add(sequence_id: int) -> None:
        # An id given with the span, as a call's is given when it arrives: the call that took 2 ends after 3.
        span = {"name": "agent.step", "attempt_id": attempt_id, "sequence_id": sequence_id, "start_time": time.time()}
        with demo.admin() as admin:
            admin.post(f"/admin/v1/rollouts/{rollout_id}/spans", json={"spans": [span]}).raise_for_status()

    add(1)
    add(3)
    p = page.page
    p.goto(f"{demo.url}/ui/rollouts/{rollout_id}")
    loaded(p)
    spans = p.locator("#calls article")

    def shown() -> list[int]:
        found: list[int] = spans.evaluate_all("spans => spans.map(s => Number(s.dataset.sequence))")
        return found

    expect(spans).to_have_count(2)
    assert shown() == [1, 3]
    add(2)
    expect(spans).to_have_count(3, timeout=4 * LIVE * 1000)
    assert shown() == [1, 2, 3]
    add(4)
    expect(spans).to_have_count(4, timeout=4 * LIVE * 1000)
    assert shown() == [1, 2, 3, 4]
    assert page.problems() == []


def test_a_call_that_failed_shows_its_error_beside_the_calls_that_did_not(demo: Filled, page: Watched) -> None:
    from openai import BadRequestError, OpenAI

    with demo.admin() as admin:
        claim = admin.post("/admin/v1/rollouts/start", json={"worker_id": "ui-test"}).json()
    ask: dict[str, Any] = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    with OpenAI(base_url=claim["base_url"], api_key=claim["api_key"], max_retries=0) as llm:
        llm.chat.completions.create(**ask)
        demo.mock.add_faults({"kind": "status", "status": 400, "times": 1, "body": {"error": {"message": "bad ask"}}})
        with pytest.raises(BadRequestError):
            llm.chat.completions.create(**ask)
    with demo.admin() as admin:
        calls, _ = call_spans(admin, claim["rollout"]["rollout_id"])
    failed = calls[1]
    assert failed["status"]["status_code"] == "ERROR"
    message = failed["attributes"].get("rollway.error") or failed["status"]["description"]
    page.page.goto(f"{demo.url}/ui/rollouts/{claim['rollout']['rollout_id']}")
    loaded(page.page)
    expect(page.page.locator("article.call")).to_have_count(2)
    expect(page.page.locator("#call-1 .badge")).to_have_text("ok")
    expect(page.page.locator("#call-1 .call-error")).to_have_count(0)
    expect(page.page.locator("#call-2 .badge")).to_have_text("error")
    expect(page.page.locator("#call-2 .call-error")).to_contain_text(message)
    expect(page.page.locator("svg.timeline .tick")).to_have_count(2)
    expect(page.page.locator("svg.timeline .tick.error")).to_have_attribute("data-sequence", "2")
    expect(page.page.locator("#no-rewards")).to_be_visible()
    expect(page.page.locator("#training")).to_contain_text("once the rollout has finished")
    assert page.problems() == []


def test_a_rollout_of_200_calls_renders_without_freezing(demo: Filled, page: Watched) -> None:
    from openai import OpenAI

    with demo.admin() as admin:
        claim = admin.post("/admin/v1/rollouts/start", json={"worker_id": "ui-test", "mode": "val"}).json()
    messages: list[Any] = [{"role": "system", "content": "Count."}]
    with OpenAI(base_url=claim["base_url"], api_key=claim["api_key"], max_retries=0) as llm:
        for i in range(200):
            messages.append({"role": "user", "content": f"step {i}"})
            answer = llm.chat.completions.create(model="policy", messages=messages, max_tokens=16)
            messages.append({"role": "assistant", "content": answer.choices[0].message.content})
    rollout_id = claim["rollout"]["rollout_id"]

    page.page.goto(f"{demo.url}/ui/rollouts/{rollout_id}")
    expect(page.page.locator("#calls-progress")).to_have_text("200 calls", timeout=20_000)
    loaded(page.page)
    started = time.monotonic()
    assert page.page.evaluate("() => document.querySelectorAll('article.call').length") == 200
    assert time.monotonic() - started < 5  # the page's thread is free: it answers at once
    drawn = page.page.evaluate("() => document.querySelectorAll('.call-body:not(.placeholder)').length")
    assert 0 < drawn < 200  # the calls far below the viewport are not drawn yet
    expect(page.page.locator("svg.timeline .tick")).to_have_count(200)
    last = page.page.locator("#call-200")
    last.scroll_into_view_if_needed()
    expect(last.locator(".response-text")).to_be_visible()
    assert page.problems() == []


def test_the_resources_page_lists_each_version_and_marks_the_latest(demo: Filled, page: Watched) -> None:
    with demo.admin() as admin:
        first = admin.post("/admin/v1/resources", json={"resources": {"prompt": "v1 prompt"}}).json()
        resources_id = first["resources_id"]
        admin.put(f"/admin/v1/resources/{resources_id}", json={"resources": {"prompt": "v2 prompt"}})
        listed = admin.get("/admin/v1/resources", params={"limit": 1000}).json()["items"]
        latest = admin.get("/admin/v1/resources/latest").json()
    page.page.goto(f"{demo.url}/ui/resources")
    loaded(page.page)
    rows = page.page.locator("#resources-table tbody tr")
    shown = rows.evaluate_all("rows => rows.map(r => [r.dataset.resourcesId, Number(r.dataset.version)])")
    assert shown == [[r["resources_id"], r["version"]] for r in listed]
    assert [resources_id, 2] in shown
    marked = page.page.locator("#resources-table tbody tr:has(.badge)")
    expect(marked).to_have_count(1)
    expect(marked).to_have_attribute("data-version", str(latest["version"]))
    marked.locator("summary").click()
    expect(marked.locator("pre.json")).to_contain_text("v2 prompt")
    assert page.problems() == []


def test_the_pages_need_no_token_but_carry_a_content_security_policy(demo: Filled) -> None:
    with httpx.Client(base_url=demo.url) as client:
        for path in ("/ui", "/ui/rollouts", "/ui/rollouts/x", "/ui/groups/g", "/ui/models/a/b", "/ui/resources"):
            answer = client.get(path)
            assert answer.status_code == 200, path
            assert "default-src 'none'" in answer.headers["content-security-policy"]
            assert '<script type="module" src="/ui/static/app.js">' in answer.text
        script = client.get("/ui/static/pages/rollout.js")
        assert script.headers["content-type"].startswith("text/javascript")
        same = {"If-None-Match": script.headers["etag"]}
        assert client.get("/ui/static/pages/rollout.js", headers=same).status_code == 304
        assert client.get("/ui/static/app.js", headers=same).status_code == 200
        assert client.get("/ui/static/../../settings.py").status_code == 404
        assert client.get("/ui/static/index.html").status_code == 404
        assert client.get("/ui/nothing").status_code == 404


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Filled]:
    """A gateway with an admin token, filled by the demo loop (a smaller run)."""
    token = "ui-" + secrets.token_urlsafe(24)
    with filled_gateway(tmp_path_factory.mktemp("ui-token"), token=token, problems=1, group_size=2) as filled:
        yield filled


def test_with_an_admin_token_the_ui_asks_once_and_the_token_stays_out_of_urls_and_logs(
    guarded: Filled, page: Watched
) -> None:
    token = guarded.token
    assert token is not None
    with httpx.Client(base_url=guarded.url) as client:
        assert client.get("/admin/v1/stats/status").status_code == 401  # the API refuses without it
        assert client.get("/ui").status_code == 200  # the page itself holds no data

    p = page.page
    p.goto(f"{guarded.url}/ui")
    dialog = p.locator("#token-dialog")
    expect(dialog).to_be_visible()
    p.fill("#token-input", "not-the-token")
    p.click("#token-submit")
    expect(p.locator("#token-error")).to_be_visible()  # refused: asked again, saying so
    p.fill("#token-input", token)
    shot(p, "token")
    p.click("#token-submit")
    loaded(p)
    expect(dialog).to_be_hidden()
    refused = len(page.errors)  # the browser logs each 401 of the tries before the token was given
    with guarded.admin() as admin:
        stats = admin.get("/admin/v1/stats").json()
    expect(p.locator("#status-counts a[data-status='succeeded'] .count")).to_have_text(
        str(stats["rollouts_by_status"]["succeeded"])
    )

    # Other pages, by link and by reload: no second question (the token is in this tab's session storage).
    p.click("header nav a[data-section=rollouts]")
    loaded(p)
    p.locator("#rollouts-table tbody tr a").first.click()
    expect(p.locator("#rollout-id")).to_be_visible()
    loaded(p)
    p.reload()
    loaded(p)
    expect(dialog).to_be_hidden()
    assert p.evaluate("() => Object.keys(sessionStorage)") == ["rollway.adminToken"]

    assert page.urls and not [u for u in page.urls if token in u]
    output = list(guarded.gateway.output)
    assert any("/ui" in line for line in output)  # the server's access log saw the pages
    assert not [line for line in output if token in line]
    # The refused tries (no token, then a wrong one) are the only errors, and none came once the token was given.
    assert refused > 0 and page.problems(allowed=("status of 401",)) == []
    assert page.errors[refused:] == []
