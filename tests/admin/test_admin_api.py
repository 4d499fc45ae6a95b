"""The control plane over HTTP: auth on every route, bad input, the retry path, swap through the API, and the
whole loop with runner processes and the openai SDK. The app is served in process, but for the whole loop, whose
runners are processes of their own and call a real server."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from rollway.mock import MockBackendProcess
from support.gateway_harness import RunningGateway

pytestmark = pytest.mark.in_process

TOKEN = "admin-secret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def gateway_settings() -> dict[str, Any]:
    return {"admin_token": TOKEN, "watchdog_interval": 0.2}


@pytest.fixture
async def admin(gw: RunningGateway) -> AsyncIterator[httpx.AsyncClient]:
    async with gw.http(headers=AUTH, timeout=30) as client:
        yield client


async def put_policy(admin: httpx.AsyncClient, mock: MockBackendProcess, version: str = "v1") -> None:
    backend = {
        "backend_id": f"mock-{version}",
        "base_url": mock.base_url,
        "kind": "vllm",
        "model": "mock-model",
        "api_key": "sk-backend-secret",
    }
    response = await admin.put("/admin/v1/models/policy", json={"backends": [backend], "version": version})
    assert response.status_code == 200, response.text


def admin_routes(gw: RunningGateway) -> list[tuple[str, str]]:
    """Every admin operation, from the OpenAPI document (so a new route cannot skip this test)."""
    paths = gw.app.api.openapi()["paths"]
    return [(m.upper(), p) for p, ops in paths.items() if p.startswith("/admin/v1") for m in ops]


def concrete(path: str) -> str:
    return path.replace("{", "x-").replace("}", "")


async def test_every_admin_route_refuses_missing_wrong_and_foreign_tokens(gw: RunningGateway) -> None:
    routes = admin_routes(gw)
    assert len(routes) >= 20
    _, gateway_key = await gw.store.mint_key("gateway")
    async with gw.http() as client:
        for method, path in routes:
            url = concrete(path)
            missing = await client.request(method, url)
            assert missing.status_code == 401, (method, path, missing.text)
            assert missing.json()["error"]["type"] == "authentication_error"
            wrong = await client.request(method, url, headers={"Authorization": "Bearer not-the-token"})
            assert wrong.status_code == 401, (method, path)
            foreign = await client.request(method, url, headers={"Authorization": f"Bearer {gateway_key}"})
            assert foreign.status_code == 403, (method, path)
            assert "not-the-token" not in wrong.text and gateway_key not in foreign.text


async def test_admin_scoped_key_works_like_the_token(gw: RunningGateway, admin: httpx.AsyncClient) -> None:
    minted = (await admin.post("/admin/v1/keys", json={"scope": "admin"})).json()
    async with gw.http(headers={"Authorization": f"Bearer {minted['key']}"}) as client:
        assert (await client.get("/admin/v1/stats")).status_code == 200
    assert (await admin.delete(f"/admin/v1/keys/{minted['key_id']}")).status_code == 204
    async with gw.http(headers={"Authorization": f"Bearer {minted['key']}"}) as client:
        assert (await client.get("/admin/v1/stats")).status_code == 401


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("POST", "/admin/v1/rollouts", {"tasks": []}, 400),
        ("POST", "/admin/v1/rollouts", {"tasks": [{"input": 1, "config": {"max_attempts": 0}}]}, 400),
        ("POST", "/admin/v1/rollouts", {"tasks": [{"input": 1, "config": {"timeout_seconds": -1}}]}, 400),
        ("POST", "/admin/v1/rollouts", {"tasks": [{"input": 1, "bogus": True}]}, 400),
        ("GET", "/admin/v1/rollouts?limit=-1", None, 400),
        ("GET", "/admin/v1/rollouts?cursor=not-a-cursor", None, 400),
        ("GET", "/admin/v1/rollouts?status=nonsense", None, 400),
        ("GET", "/admin/v1/rollouts?order=newest", None, 400),
        ("GET", "/admin/v1/rollouts/ro-missing", None, 404),
        ("POST", "/admin/v1/rollouts/ro-missing/cancel", None, 404),
        ("PATCH", "/admin/v1/rollouts/ro-missing/attempts/latest", {"status": "succeeded"}, 404),
        ("POST", "/admin/v1/rollouts/ro-missing/rewards", {"value": 1}, 404),
        ("POST", "/admin/v1/claims", {"limit": -3}, 400),
        ("POST", "/admin/v1/rollouts/wait", {"rollout_ids": ["ro-missing"], "timeout_seconds": 0}, 404),
        ("POST", "/admin/v1/rollouts/wait", {"rollout_ids": ["x"], "timeout_seconds": 3600}, 400),
        ("GET", "/admin/v1/models/none", None, 404),
        ("PUT", "/admin/v1/models/m", {"backends": []}, 400),
        ("PUT", "/admin/v1/models/m", {"backends": [{"base_url": "http://x/v1", "kind": "nope", "model": "m"}]}, 400),
        ("GET", "/admin/v1/resources/rs-missing", None, 404),
        ("DELETE", "/admin/v1/keys/key-missing", None, 404),
        ("GET", "/admin/v1/groups/gr-missing", None, 404),
    ],
)
async def test_bad_input_gets_a_clear_4xx_envelope(
    admin: httpx.AsyncClient, method: str, path: str, body: Any, status: int
) -> None:
    response = await admin.request(method, path, json=body)
    assert response.status_code == status, response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


async def test_direct_starts_name_the_size_of_the_group_they_join(admin: httpx.AsyncClient) -> None:
    """POST /rollouts/start with group_id and group_size: one rollout, at the group's next index, in a group of
    that size; another size, or a member more than the size, is a 400 saying so; a keyed start sent again after
    the group filled up is its first answer."""
    task = {"input": "q", "group_id": "grpo-7", "group_size": 2, "worker_id": "w"}
    first = await admin.post("/admin/v1/rollouts/start", json=task, headers={"Idempotency-Key": "start-a"})
    assert first.status_code == 201, first.text
    assert (first.json()["rollout"]["group_size"], first.json()["rollout"]["group_index"]) == (2, 0)
    other_size = await admin.post("/admin/v1/rollouts/start", json={**task, "group_size": 3})
    assert other_size.status_code == 400
    assert "group 'grpo-7' has size 2 (1 member), not 3" in other_size.json()["error"]["message"]
    second = await admin.post("/admin/v1/rollouts/start", json=task)
    assert second.status_code == 201 and second.json()["rollout"]["group_index"] == 1
    full = await admin.post("/admin/v1/rollouts/start", json=task)
    assert full.status_code == 400 and "no room for another member" in full.json()["error"]["message"]
    again = await admin.post("/admin/v1/rollouts/start", json=task, headers={"Idempotency-Key": "start-a"})
    assert again.status_code == 201 and again.json()["rollout"] == first.json()["rollout"]
    view = (await admin.get("/admin/v1/groups/grpo-7")).json()
    assert (view["size"], view["finished"], view["complete"], len(view["rollouts"])) == (2, 0, False, 2)
    no_group = await admin.post("/admin/v1/rollouts/start", json={"input": "q", "group_size": 2})
    assert no_group.status_code == 400 and "needs a group_id" in no_group.json()["error"]["message"]


async def test_malformed_json_body_is_a_400_and_the_server_keeps_serving(admin: httpx.AsyncClient) -> None:
    response = await admin.post(
        "/admin/v1/rollouts", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 400
    assert (await admin.get("/admin/v1/stats")).status_code == 200


async def test_invalid_transition_is_a_409_naming_the_states(admin: httpx.AsyncClient) -> None:
    [rollout] = (await admin.post("/admin/v1/rollouts", json={"tasks": [{"input": 1}]})).json()["rollouts"]
    await admin.post("/admin/v1/claims", json={"worker_id": "w"})
    done = await admin.patch(
        f"/admin/v1/rollouts/{rollout['rollout_id']}/attempts/latest", json={"status": "succeeded"}
    )
    assert done.status_code == 200
    again = await admin.patch(f"/admin/v1/rollouts/{rollout['rollout_id']}/attempts/latest", json={"status": "failed"})
    assert again.status_code == 409
    assert "succeeded" in again.json()["error"]["message"] and "failed" in again.json()["error"]["message"]
    cancel = await admin.post(f"/admin/v1/rollouts/{rollout['rollout_id']}/cancel")
    assert cancel.status_code == 409


async def test_models_never_return_backend_api_keys(admin: httpx.AsyncClient, mock: MockBackendProcess) -> None:
    await put_policy(admin, mock)
    for response in (await admin.get("/admin/v1/models"), await admin.get("/admin/v1/models/policy")):
        assert "sk-backend-secret" not in response.text
        assert response.status_code == 200
    view = (await admin.get("/admin/v1/models/policy")).json()
    assert view["backends"][0]["has_api_key"] is True
    assert view["state"] == {"paused": False, "in_flight": 0, "in_flight_old": 0, "updating": None}


async def test_retry_path_requeues_failed_attempt_and_refuses_the_old_key(
    gw: RunningGateway, admin: httpx.AsyncClient, mock: MockBackendProcess
) -> None:
    await put_policy(admin, mock)
    task = {"input": {"q": 1}, "config": {"max_attempts": 2, "retry_condition": ["failed"]}}
    [rollout] = (await admin.post("/admin/v1/rollouts", json={"tasks": [task]})).json()["rollouts"]
    rid = rollout["rollout_id"]
    [first] = (await admin.post("/admin/v1/claims", json={"worker_id": "w1"})).json()["claims"]
    old = gw.client(api_key=first["api_key"])
    await old.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    failed = await admin.patch(f"/admin/v1/rollouts/{rid}/attempts/latest", json={"status": "failed"})
    assert failed.status_code == 200
    assert (await admin.get(f"/admin/v1/rollouts/{rid}")).json()["status"] == "requeuing"
    [second] = (await admin.post("/admin/v1/claims", json={"worker_id": "w2"})).json()["claims"]
    assert second["rollout"]["rollout_id"] == rid and second["attempt"]["sequence_id"] == 2
    with pytest.raises(Exception) as refused:
        await old.chat.completions.create(model="policy", messages=[{"role": "user", "content": "late"}])
    assert getattr(refused.value, "status_code", None) in (403, 409)
    new = gw.client(base_url=second["base_url"], api_key=second["api_key"])
    await new.chat.completions.create(model="policy", messages=[{"role": "user", "content": "again"}])
    spans = (await admin.get(f"/admin/v1/rollouts/{rid}/spans", params={"attempt_id": "latest"})).json()["items"]
    assert [s["attempt_id"] for s in spans] == [second["attempt"]["attempt_id"]]
    await admin.post(f"/admin/v1/rollouts/{rid}/rewards", json={"value": 0.5})
    await admin.patch(f"/admin/v1/rollouts/{rid}/attempts/latest", json={"status": "succeeded"})
    triplets = (await admin.get("/admin/v1/triplets", params={"rollout_id": rid})).json()["items"]
    assert [(t["attempt_id"], t["reward"]) for t in triplets] == [(second["attempt"]["attempt_id"], 0.5)]


async def test_runner_that_stops_heartbeating_gets_its_rollout_requeued(admin: httpx.AsyncClient) -> None:
    task = {"input": 1, "config": {"unresponsive_seconds": 0.3, "max_attempts": 2, "retry_condition": ["unresponsive"]}}
    [rollout] = (await admin.post("/admin/v1/rollouts", json={"tasks": [task]})).json()["rollouts"]
    [first] = (await admin.post("/admin/v1/claims", json={"worker_id": "silent"})).json()["claims"]
    # No span, no heartbeat: the watchdog (every 0.2 s here) requeues it; the long-poll wakes up with it.
    claims = (await admin.post("/admin/v1/claims", json={"worker_id": "w2", "wait_seconds": 10})).json()["claims"]
    assert [c["rollout"]["rollout_id"] for c in claims] == [rollout["rollout_id"]]
    attempts = (await admin.get(f"/admin/v1/rollouts/{rollout['rollout_id']}")).json()["attempts"]
    assert [a["status"] for a in attempts] == ["unresponsive", "preparing"]
    assert attempts[0]["attempt_id"] == first["attempt"]["attempt_id"]


async def test_swap_through_the_admin_api_while_runners_call(
    gw: RunningGateway, admin: httpx.AsyncClient, mock: MockBackendProcess
) -> None:
    await put_policy(admin, mock, "v1")
    await admin.post("/admin/v1/rollouts", json={"tasks": [{"input": i} for i in range(4)]})
    claims = (await admin.post("/admin/v1/claims", json={"worker_id": "w", "limit": 4})).json()["claims"]
    stop = asyncio.Event()
    failures: list[BaseException] = []

    async def runner(claim: dict[str, Any]) -> int:
        client = gw.client(base_url=claim["base_url"], api_key=claim["api_key"])
        calls = 0
        while not stop.is_set() or calls < 3:
            try:
                await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "go"}])
            except Exception as exc:  # every call must succeed
                failures.append(exc)
                return calls
            calls += 1
        return calls

    tasks = [asyncio.create_task(runner(c)) for c in claims]
    assert (await admin.post("/admin/v1/models/policy/pause")).json()["state"]["paused"] is True
    backend = {"backend_id": "mock-v2", "base_url": mock.base_url, "kind": "vllm", "model": "mock-model"}
    swapped = await admin.post(
        "/admin/v1/models/policy/swap", json={"backends": [backend], "version": "v2", "drain_timeout_seconds": 10}
    )
    assert swapped.status_code == 200 and swapped.json()["version"] == "v2"
    assert (await admin.post("/admin/v1/models/policy/resume")).json()["state"]["paused"] is False
    stop.set()
    counts = await asyncio.gather(*tasks)
    assert failures == [] and all(n >= 3 for n in counts)
    for claim in claims:
        spans = await gw.store.query_spans(claim["rollout"]["rollout_id"])
        versions = [s.attributes["rollway.model_version"] for s in spans]
        assert versions[-1] == "v2"
        assert versions == sorted(versions)  # v1 calls, then only v2 calls


@pytest.mark.slow
@pytest.mark.in_process(False)  # the runners are processes of their own: they need the gateway's address
async def test_full_loop_with_runner_processes(
    gw: RunningGateway, admin: httpx.AsyncClient, mock: MockBackendProcess
) -> None:
    await put_policy(admin, mock)
    tasks = [
        {"input": {"question": f"What is {i} + {i * 3}?", "answer": i * 4}, "group_size": 4, "mode": "train"}
        for i in range(16)
    ]
    rollouts = (await admin.post("/admin/v1/rollouts", json={"tasks": tasks})).json()["rollouts"]
    assert len(rollouts) == 64
    runners = [
        await asyncio.create_subprocess_exec(
            sys.executable, str(ROOT / "tests" / "support" / "loop_runner.py"), gw.url, TOKEN, f"runner-{i}", cwd=ROOT
        )
        for i in range(4)
    ]
    ids = [r["rollout_id"] for r in rollouts]
    waited = (await admin.post("/admin/v1/rollouts/wait", json={"rollout_ids": ids, "timeout_seconds": 60})).json()
    codes = await asyncio.wait_for(asyncio.gather(*(r.wait() for r in runners)), 120)
    assert codes == [0, 0, 0, 0]
    assert waited["pending"] == []
    assert {r["status"] for r in waited["finished"]} == {"succeeded"}
    groups = {r["group_id"] for r in rollouts}
    assert len(groups) == 16
    for group_id in groups:
        view = (await admin.get(f"/admin/v1/groups/{group_id}")).json()
        assert view["complete"] is True and view["size"] == 4
    workers = {a["worker_id"] for r in ids for a in (await admin.get(f"/admin/v1/rollouts/{r}")).json()["attempts"]}
    assert len(workers) >= 2
    triplets = (await admin.get("/admin/v1/triplets", params={"limit": 1000})).json()["items"]
    assert {t["group_id"] for t in triplets} == groups  # 16 complete groups
    by_rollout: dict[str, list[dict[str, Any]]] = {}
    for triplet in triplets:
        by_rollout.setdefault(triplet["rollout_id"], []).append(triplet)
    assert set(by_rollout) == set(ids)
    async with AsyncOpenAI(base_url=mock.base_url, api_key="unused", max_retries=0) as direct:
        for rollout_id, calls in by_rollout.items():
            assert len(calls) == 2
            # The reward goes to the last call; the first stays unrewarded (null, never 0).
            spans = (await admin.get(f"/admin/v1/rollouts/{rollout_id}/spans")).json()["items"]
            [reward] = [s["attributes"]["rollway.reward.value"] for s in spans if s["name"] == "rollway.reward"]
            assert [c["reward"] for c in calls] == [None, reward]
            for call in calls:  # the backend's own token ids, asked of it directly
                truth = await direct.chat.completions.create(
                    model="mock-model", messages=call["messages"], max_tokens=16, extra_body={"return_token_ids": True}
                )
                extra, choice_extra = truth.model_extra, truth.choices[0].model_extra
                assert extra is not None and choice_extra is not None  # the token ids come as extra fields
                assert call["prompt_token_ids"] == extra["prompt_token_ids"]
                assert call["response_token_ids"] == choice_extra["token_ids"]


async def test_no_secret_reaches_a_log_line_a_response_or_a_span(
    gw: RunningGateway, admin: httpx.AsyncClient, mock: MockBackendProcess, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG")
    secret = "sk-backend-secret"
    dead = {"backend_id": "dead", "base_url": "http://127.0.0.1:9/v1", "kind": "vllm", "model": "m", "api_key": secret}
    live = {"backend_id": "live", "base_url": mock.base_url, "kind": "vllm", "model": "mock-model", "api_key": secret}
    responses = [await admin.put("/admin/v1/models/policy", json={"backends": [dead, live]})]
    minted = await admin.post("/admin/v1/keys", json={"scope": "gateway"})
    [rollout] = (await admin.post("/admin/v1/rollouts", json={"tasks": [{"input": 1}]})).json()["rollouts"]
    [claim] = (await admin.post("/admin/v1/claims", json={"worker_id": "w"})).json()["claims"]
    client = gw.client(base_url=claim["base_url"], api_key=claim["api_key"])
    for _ in range(3):  # some of these go to the dead backend first: errors, retries, failover get logged
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    responses += [
        await admin.get("/admin/v1/models"),
        await admin.get(f"/admin/v1/rollouts/{rollout['rollout_id']}/spans"),
        await admin.get("/admin/v1/triplets", params={"rollout_id": rollout["rollout_id"], "partial": True}),
    ]
    async with gw.http() as anonymous:
        responses.append(await anonymous.get("/admin/v1/stats", headers={"Authorization": "Bearer wrong-token"}))
    logged = "\n".join(record.getMessage() + str(record.exc_info or "") for record in caplog.records)
    for secret_text in (secret, TOKEN, claim["api_key"], minted.json()["key"]):
        assert secret_text not in logged
    for response in responses:
        assert secret not in response.text and TOKEN not in response.text
    assert "wrong-token" not in responses[-1].text


async def test_strings_that_are_not_unicode_are_a_400_not_a_stored_500(tmp_path: Path) -> None:
    import httpx

    from rollway.settings import Settings
    from support.gateway_harness import app_lifespan

    async with app_lifespan(Settings(database_url=f"sqlite:///{tmp_path / 'u.db'}")) as app:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            started = await client.post("/admin/v1/rollouts/start", json={"input": 1, "rollout_id": "ro-1"})
            assert started.status_code == 201
            headers = {"content-type": "application/json"}
            for path, body in [
                ("/admin/v1/rollouts/ro-1/spans", '{"spans": [{"name": "x", "attributes": {"a": "\\ud8f3"}}]}'),
                ("/admin/v1/rollouts", '{"tasks": [{"input": "\\udc00"}]}'),
                ("/admin/v1/rollouts/start", '{"input": {"q": "\\ud800"}}'),
            ]:
                answer = await client.post(path, content=body, headers=headers)
                assert answer.status_code == 400 and "Unicode" in answer.json()["error"]["message"], answer.text
            assert (await client.get("/admin/v1/rollouts/ro-1/spans")).json()["items"] == []
            assert len((await client.get("/admin/v1/rollouts")).json()["items"]) == 1


async def test_an_alias_with_a_slash_is_managed_and_served(
    gw: RunningGateway, admin: httpx.AsyncClient, mock: MockBackendProcess
) -> None:
    # Hugging Face style names are the usual aliases; the admin client percent-encodes the '/'.
    alias, encoded = "Qwen/Qwen2.5-7B-Instruct", "Qwen%2FQwen2.5-7B-Instruct"
    backend = {"backend_id": "b1", "base_url": mock.base_url, "kind": "vllm", "model": "mock-model"}
    put = await admin.put(f"/admin/v1/models/{encoded}", json={"backends": [backend], "version": "v1"})
    assert put.status_code == 200, put.text
    assert put.json()["alias"] == alias
    assert (await admin.get(f"/admin/v1/models/{alias}")).json()["version"] == "v1"
    assert (await admin.post(f"/admin/v1/models/{alias}/pause")).json()["state"]["paused"] is True
    assert (await admin.post(f"/admin/v1/models/{encoded}/resume")).json()["state"]["paused"] is False
    swapped = await admin.post(f"/admin/v1/models/{alias}/swap", json={"version": "v2"})
    assert swapped.json()["version"] == "v2"
    # New weights at another backend, its kind not given: the alias's (vllm), so token ids are still captured.
    step = {"backend_id": "b2", "base_url": mock.base_url, "model": "mock-model"}
    swapped = await admin.post(f"/admin/v1/models/{alias}/swap", json={"backends": [step]})
    assert [b["kind"] for b in swapped.json()["backends"]] == ["vllm"]
    mixed = [backend, {**step, "kind": "openai"}]
    assert (
        await admin.put(f"/admin/v1/models/{encoded}", json={"backends": mixed, "version": "v3"})
    ).status_code == 200
    refused = await admin.post(f"/admin/v1/models/{alias}/swap", json={"backends": [step]})
    assert refused.status_code == 400 and "several kinds" in refused.json()["error"]["message"]
    assert (await admin.get(f"/admin/v1/models/{alias}")).json()["version"] == "v3"  # unchanged
    answer = await gw.client().chat.completions.create(model=alias, messages=[{"role": "user", "content": "hi"}])
    assert answer.choices[0].message.content
    assert (await admin.delete(f"/admin/v1/models/{alias}")).status_code == 204
    assert (await admin.get(f"/admin/v1/models/{encoded}")).status_code == 404


async def test_another_method_on_an_action_path_is_a_405_not_a_new_alias(
    admin: httpx.AsyncClient, mock: MockBackendProcess
) -> None:
    await put_policy(admin, mock)
    backend = {"backend_id": "b2", "base_url": mock.base_url, "kind": "vllm", "model": "mock-model"}
    for method, path in [
        ("PUT", "/admin/v1/models/policy/pause"),
        ("PUT", "/admin/v1/models/policy%2Fswap"),
        ("GET", "/admin/v1/models/policy/resume"),
        ("DELETE", "/admin/v1/models/policy/pause"),
    ]:
        answer = await admin.request(method, path, json={"backends": [backend]} if method == "PUT" else None)
        assert answer.status_code == 405, (method, path, answer.text)
        assert answer.headers["allow"] == "POST"
        assert "use POST" in answer.json()["error"]["message"]
    [model] = (await admin.get("/admin/v1/models")).json()["items"]
    assert (model["alias"], model["version"], model["state"]["paused"]) == ("policy", "v1", False)
