"""The admin routes the dashboard reads besides the older ones: the cheap counts (``/stats/status``), the calls
over a recent window (``/stats/series``) and spans a page at a time or by name (``/rollouts/{id}/spans``).
Each answer is compared with what the store holds, on the whole app served in process (SQLite, and PostgreSQL
when reachable) with real calls to the mock backend."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from openai import BadRequestError
from openai.types.chat import ChatCompletionMessageParam

from rollway.admin import series
from rollway.mock import MockBackendProcess
from support.gateway_harness import Alias, RunningGateway, closed_port

pytestmark = pytest.mark.in_process

TOKEN = "ui-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def gateway_settings(store_url: str) -> dict[str, Any]:
    """A gateway on a SQLite file and on a fresh PostgreSQL database (the series query's SQL differs)."""
    return {"admin_token": TOKEN, "database_url": store_url}


@pytest.fixture
def gateway_aliases(mock: MockBackendProcess) -> list[Alias]:
    backend = {"backend_id": "mock", "base_url": mock.base_url, "kind": "vllm", "model": "mock-model"}
    return [Alias("policy", [backend], version="v1")]


@pytest.fixture
async def admin(gw: RunningGateway) -> AsyncIterator[httpx.AsyncClient]:
    async with gw.http(headers=AUTH, timeout=30) as client:
        yield client


async def started(admin: httpx.AsyncClient) -> dict[str, Any]:
    answer = await admin.post("/admin/v1/rollouts/start", json={"worker_id": "w"})
    assert answer.status_code == 201, answer.text
    claim: dict[str, Any] = answer.json()
    return claim


async def chat(gw: RunningGateway, claim: dict[str, Any], calls: int, *, stream: bool = False) -> None:
    """``calls`` chat calls through the claim's ``base_url``, with its key."""
    async with gw.client(claim["base_url"], api_key=claim["api_key"]) as llm:
        for i in range(calls):
            messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": f"q{i}"}]
            if stream:
                async for _ in await llm.chat.completions.create(
                    model="policy", messages=messages, max_tokens=8, stream=True
                ):
                    pass
            else:
                await llm.chat.completions.create(model="policy", messages=messages, max_tokens=8)


async def test_status_counts_match_the_full_stats(admin: httpx.AsyncClient) -> None:
    await admin.post("/admin/v1/rollouts", json={"tasks": [{"input": i} for i in range(3)]})
    await started(admin)
    counts = (await admin.get("/admin/v1/stats/status")).json()
    full = (await admin.get("/admin/v1/stats")).json()
    assert counts["rollouts_by_status"] == full["rollouts_by_status"]
    assert counts["queue_depth"] == full["queue_depth"] == 3
    assert sum(counts["rollouts_by_status"].values()) == 4
    assert {k: v for k, v in counts["attempts_by_status"].items() if v} == full["attempts_by_status"]
    assert sum(counts["attempts_by_status"].values()) == 1


async def test_the_series_counts_every_call_of_the_window_with_its_tokens_and_latency(
    gw: RunningGateway, admin: httpx.AsyncClient, mock: MockBackendProcess
) -> None:
    claim = await started(admin)
    await chat(gw, claim, 3)
    await chat(gw, claim, 2, stream=True)
    mock.add_faults({"kind": "status", "status": 400, "times": 1})  # a 4xx: passed on, not retried
    with pytest.raises(BadRequestError):
        await chat(gw, claim, 1)
    await admin.post(f"/admin/v1/rollouts/{claim['rollout']['rollout_id']}/rewards", json={"value": 1.0})

    spans = (await admin.get(f"/admin/v1/rollouts/{claim['rollout']['rollout_id']}/spans")).json()["items"]
    calls = [s for s in spans if "rollway.latency_seconds" in s["attributes"]]
    assert len(calls) == 6  # the reward is a span, not a call
    view = (await admin.get("/admin/v1/stats/series", params={"window_seconds": 600, "step_seconds": 60})).json()
    points = view["points"]
    assert len(points) == 10 and view["step_seconds"] == 60
    assert [p["start"] for p in points] == [view["since"] + 60 * i for i in range(10)]
    assert sum(p["calls"] for p in points) == 6
    assert sum(p["errors"] for p in points) == 1
    inputs = sum(s["attributes"].get("gen_ai.usage.input_tokens") or 0 for s in calls)
    outputs = sum(s["attributes"].get("gen_ai.usage.output_tokens") or 0 for s in calls)
    assert sum(p["input_tokens"] for p in points) == inputs > 0
    assert sum(p["output_tokens"] for p in points) == outputs > 0
    busy = [p for p in points if p["calls"]]
    latencies = [s["attributes"]["rollway.latency_seconds"] for s in calls]
    assert max(p["latency_max_seconds"] for p in busy) == pytest.approx(max(latencies))
    assert any(p["ttft_mean_seconds"] is not None for p in busy)  # the streamed calls
    assert all(p["latency_mean_seconds"] is None and p["calls_per_second"] == 0 for p in points if not p["calls"])
    # The reward, and one named otherwise (an auxiliary dimension), which the series leaves out.
    rewarded = [p for p in points if p["rewards"]]
    assert [(p["rewards"], p["reward_mean"]) for p in rewarded] == [(1, 1.0)]
    await admin.post(
        f"/admin/v1/rollouts/{claim['rollout']['rollout_id']}/rewards", json={"value": 0.5, "name": "format"}
    )
    again = (await admin.get("/admin/v1/stats/series", params={"window_seconds": 600, "step_seconds": 60})).json()
    assert sum(p["rewards"] for p in again["points"]) == 1


async def test_the_series_leaves_out_calls_before_the_window(gw: RunningGateway, admin: httpx.AsyncClient) -> None:
    claim = await started(admin)
    await chat(gw, claim, 2)
    # Calls older than the window: the first key of the window is found past them.
    assert await gw.store.read(lambda conn: series.first_pk_since(conn, time.time() + 3600)) is not None
    later = await gw.store.read(lambda conn: series.call_buckets(conn, time.time() + 1, 60))
    assert later == []
    now = await gw.store.read(lambda conn: series.call_buckets(conn, time.time() - 60, 60))
    assert sum(b.calls for b in now) == 2


async def test_a_client_span_whose_latency_is_not_a_number_is_not_counted_and_breaks_nothing(
    gw: RunningGateway, admin: httpx.AsyncClient
) -> None:
    """Spans come from clients too: a latency or TTFT that is text (PostgreSQL would refuse to cast it) leaves
    the span out of the series rather than failing it."""
    claim = await started(admin)
    await chat(gw, claim, 1)
    rollout_id = claim["rollout"]["rollout_id"]
    odd = {"rollway.latency_seconds": "fast", "rollway.ttft_seconds": "soon"}
    now = time.time()
    span = {"trace_id": "0" * 32, "span_id": "1" * 16, "name": "odd", "attributes": odd, "start_time": now}
    (await admin.post(f"/admin/v1/rollouts/{rollout_id}/spans", json={"spans": [span]})).raise_for_status()
    answer = await admin.get("/admin/v1/stats/series", params={"window_seconds": 600, "step_seconds": 60})
    assert answer.status_code == 200
    assert sum(p["calls"] for p in answer.json()["points"]) == 1


async def test_the_series_refuses_more_than_a_day_by_the_minute(admin: httpx.AsyncClient) -> None:
    answer = await admin.get("/admin/v1/stats/series", params={"window_seconds": 86_400, "step_seconds": 30})
    assert answer.status_code == 400
    assert "at most 1440" in answer.json()["error"]["message"]
    assert (await admin.get("/admin/v1/stats/series", params={"step_seconds": 0})).status_code == 400


async def test_spans_read_a_page_at_a_time_and_by_name(gw: RunningGateway, admin: httpx.AsyncClient) -> None:
    claim = await started(admin)
    rollout_id = claim["rollout"]["rollout_id"]
    await chat(gw, claim, 5)
    await admin.post(f"/admin/v1/rollouts/{rollout_id}/rewards", json={"value": 0.5})
    url = f"/admin/v1/rollouts/{rollout_id}/spans"
    whole = (await admin.get(url)).json()["items"]
    assert len(whole) == 6
    pages, after = [], None
    while True:
        params: dict[str, Any] = {"limit": 2, "attempt_id": claim["attempt"]["attempt_id"]}
        if after is not None:
            params["after_sequence"] = after
        items = (await admin.get(url, params=params)).json()["items"]
        pages.append(items)
        if len(items) < 2:
            break
        after = items[-1]["sequence_id"]
    assert [len(p) for p in pages] == [2, 2, 2, 0]
    assert [s["span_id"] for p in pages for s in p] == [s["span_id"] for s in whole]
    rewards = (await admin.get(url, params={"name": "rollway.reward"})).json()["items"]
    assert [s["attributes"]["rollway.reward.value"] for s in rewards] == [0.5]
    refused = await admin.get(url, params={"attempt_id": "all", "after_sequence": 1})
    assert refused.status_code == 400
    assert "one attempt" in refused.json()["error"]["message"]


async def test_rollouts_filter_by_the_model_alias_they_called(
    gw: RunningGateway, admin: httpx.AsyncClient, mock: MockBackendProcess
) -> None:
    backend = {"backend_id": "mock-b", "base_url": mock.base_url, "kind": "vllm", "model": "mock-model"}
    await gw.store.put_model("org/other", [backend], version="v1")
    policy = [await started(admin) for _ in range(3)]
    other = await started(admin)
    idle = await started(admin)  # calls nothing: in no model's list
    for claim in policy:
        await chat(gw, claim, 1)
    async with gw.client(other["base_url"], api_key=other["api_key"]) as llm:
        await llm.chat.completions.create(model="org/other", messages=[{"role": "user", "content": "q"}], max_tokens=4)

    def ids(claims: list[dict[str, Any]]) -> list[str]:
        return [c["rollout"]["rollout_id"] for c in claims]

    async def listed(**params: Any) -> dict[str, Any]:
        answer = await admin.get("/admin/v1/rollouts", params=params)
        assert answer.status_code == 200, answer.text
        page: dict[str, Any] = answer.json()
        return page

    assert [r["rollout_id"] for r in (await listed(model="policy"))["items"]] == ids(policy)
    assert [r["rollout_id"] for r in (await listed(model="org/other"))["items"]] == ids([other])
    assert (await listed(model="nobody"))["items"] == []
    assert idle["rollout"]["rollout_id"] in [r["rollout_id"] for r in (await listed())["items"]]
    seen, cursor = [], None
    while True:
        page = await listed(model="policy", limit=2, **({"cursor": cursor} if cursor else {}))
        seen += [r["rollout_id"] for r in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == ids(policy)
    assert (await listed(model="policy", status="succeeded"))["items"] == []
    bad = await admin.get("/admin/v1/rollouts", params={"model": "policy", "cursor": "not-a-cursor"})
    assert bad.status_code == 400


async def test_rollouts_list_newest_first_with_order_desc_and_page_on_in_that_order(admin: httpx.AsyncClient) -> None:
    created = []
    for tasks in ([{"input": i} for i in range(5)], [{"input": 5}], [{"input": 6}, {"input": 7}]):
        answer = await admin.post("/admin/v1/rollouts", json={"tasks": tasks})
        created += [r["rollout_id"] for r in answer.json()["rollouts"]]
    claim = await started(admin)
    created.append(claim["rollout"]["rollout_id"])
    for rollout_id in created[1::3]:
        assert (await admin.post(f"/admin/v1/rollouts/{rollout_id}/cancel")).status_code == 200

    async def every(**params: Any) -> list[str]:
        seen: list[str] = []
        cursor = None
        while True:
            answer = await admin.get("/admin/v1/rollouts", params={**params, **({"cursor": cursor} if cursor else {})})
            assert answer.status_code == 200, answer.text
            seen += [r["rollout_id"] for r in answer.json()["items"]]
            cursor = answer.json()["next_cursor"]
            if cursor is None:
                return seen

    assert await every(order="desc") == created[::-1]
    assert await every() == await every(order="asc") == created  # oldest first unless asked
    for limit in (1, 2, 4):
        assert await every(order="desc", limit=limit) == created[::-1], limit
    cancelled = created[1::3]
    assert await every(order="desc", status="cancelled", limit=2) == cancelled[::-1]
    queuing = [r for r in created[:-1] if r not in cancelled]
    assert await every(order="desc", status="queuing", limit=3) == queuing[::-1]
    for bad in ("newest", "DESC", "", "1"):
        refused = await admin.get("/admin/v1/rollouts", params={"order": bad})
        assert refused.status_code == 400, (bad, refused.text)
        assert set(refused.json()["error"]) == {"message", "type", "param", "code"}
        assert "order" in refused.json()["error"]["message"], refused.text


async def test_models_show_each_backend_up_or_down_as_the_server_sees_it(
    gw: RunningGateway, admin: httpx.AsyncClient
) -> None:
    [backend] = (await admin.get("/admin/v1/models/policy")).json()["backends"]
    assert backend["up"] is True  # the gateway's router routes to it
    ejected = {"mock"}
    gw.app.api.state.admin.backend_up = lambda backend_id: backend_id not in ejected
    [listed] = (await admin.get("/admin/v1/models")).json()["items"]
    assert listed["backends"][0]["up"] is False
    ejected.clear()
    assert (await admin.get("/admin/v1/models/policy")).json()["backends"][0]["up"] is True


async def test_a_backend_that_does_not_answer_is_down_before_any_call(
    gw: RunningGateway, admin: httpx.AsyncClient
) -> None:
    dead = {"backend_id": "dead", "base_url": f"http://127.0.0.1:{closed_port()}/v1", "kind": "vllm", "model": "m"}
    put = await admin.put("/admin/v1/models/nowhere", json={"backends": [dead]})
    assert put.json()["backends"][0]["up"] is False  # no call has tried it: the server asked it itself
    listed = {m["alias"]: m for m in (await admin.get("/admin/v1/models")).json()["items"]}
    assert listed["nowhere"]["backends"][0]["up"] is False and listed["policy"]["backends"][0]["up"] is True
