"""Calls that name no rollout are served and recorded (docs/gateway.md); the admin API reads them back, page by page
in arrival order (``GET /admin/v1/spans/unattributed``, the client's ``get_unattributed_spans``), and a rollout's
calls never show there."""

from __future__ import annotations

from pathlib import Path

import httpx

from rollway.admin.client import AsyncRollwayClient
from rollway.mock import MockBackendProcess
from support.gateway_harness import claim_one, register, running_gateway, vllm
from support.store_helpers import filled


async def test_unattributed_calls_are_read_back_in_arrival_order_page_by_page(
    tmp_path: Path, mock: MockBackendProcess
) -> None:
    async with running_gateway(tmp_path) as gw:
        await register(gw.store, "policy", vllm(mock))
        rollout_id, _ = await claim_one(gw.store)
        anyone = gw.client(f"{gw.url}/v1")
        attributed = gw.client(f"{gw.url}/rollout/{rollout_id}/v1")
        asked = []
        for n in range(5):
            content = f"question {n}"
            asked.append(content)
            await anyone.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": content}], max_tokens=2
            )
            await attributed.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "mine"}], max_tokens=2
            )
        assert await gw.state.registry.drain("policy", 10)

        async with AsyncRollwayClient(gw.url) as client:
            pages, cursor = [], None
            while True:
                page = await client.get_unattributed_spans(limit=2, cursor=cursor)
                pages.append(page.items)
                if page.next_cursor is None:
                    break
                cursor = page.next_cursor
        assert [len(p) for p in pages] == [2, 2, 1]
        spans = [s for p in pages for s in p]
        assert [s.rollout_id for s in spans] == [None] * 5
        assert [s.sequence_id for s in spans] == sorted(filled(s.sequence_id for s in spans))
        assert [s.attributes["rollway.request"]["messages"][0]["content"] for s in spans] == asked

        async with httpx.AsyncClient(base_url=f"{gw.url}/admin/v1") as http:
            for bad in ("-1", "abc", "1" * 40):
                refused = await http.get("/spans/unattributed", params={"cursor": bad})
                assert refused.status_code == 400
                assert "cursor" in refused.json()["error"]["message"]
            assert (await http.get("/spans/unattributed", params={"limit": 0})).status_code == 400
            mine = (await http.get(f"/rollouts/{rollout_id}/spans")).json()["items"]
        assert len(mine) == 5 and {s["rollout_id"] for s in mine} == {rollout_id}
