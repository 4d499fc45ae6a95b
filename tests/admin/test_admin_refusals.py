"""What the admin API refuses, through the whole app (served in process): an ``Idempotency-Key`` sent again with
another body, client ids a URL path cannot carry, an update of a bundle that does not exist, an unknown ``mode``
filter, a backend that is not an http(s) URL and a body that is not JSON — each in the error envelope, with nothing
written."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from rollway.mock import MockBackendProcess
from support.gateway_harness import RunningGateway, vllm

pytestmark = pytest.mark.in_process

TOKEN = "admin-secret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TASKS: list[dict[str, Any]] = [
    {"input": {"q": "a"}, "config": {"max_attempts": 2}, "priority": 1, "metadata": {"set": "train"}},
    {"input": {"q": "b"}, "group_size": 2},
]


@pytest.fixture
def gateway_settings() -> dict[str, Any]:
    return {"admin_token": TOKEN}


@pytest.fixture
async def admin(gw: RunningGateway) -> AsyncIterator[httpx.AsyncClient]:
    async with gw.http("/admin/v1", headers=AUTH, timeout=30) as client:
        yield client


def error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body: dict[str, Any] = response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    return body


async def test_an_enqueue_key_sent_again_with_another_body_is_a_409_and_queues_nothing(
    admin: httpx.AsyncClient,
) -> None:
    key = {"Idempotency-Key": "enqueue-1"}
    first = await admin.post("/rollouts", json={"tasks": TASKS}, headers=key)
    assert first.status_code == 201
    again = await admin.post("/rollouts", json={"tasks": TASKS}, headers=key)
    assert again.status_code == 201 and again.json() == first.json()
    others = [
        [*TASKS, {"input": {"q": "c"}}],
        TASKS[:1],
        [{**TASKS[0], "config": {"max_attempts": 3}}, TASKS[1]],
        [{**TASKS[0], "priority": 9}, TASKS[1]],
        [{**TASKS[0], "metadata": {"set": "val"}}, TASKS[1]],
    ]
    for tasks in others:
        refused = error(await admin.post("/rollouts", json={"tasks": tasks}, headers=key), 409)
        assert refused["type"] == "conflict_error"
        assert refused["message"] == "idempotency key 'enqueue-1' was already used for a different request"
    stored = (await admin.get("/rollouts")).json()["items"]
    assert [r["rollout_id"] for r in stored] == [r["rollout_id"] for r in first.json()["rollouts"]]
    assert (stored[0]["priority"], stored[0]["config"]["max_attempts"]) == (1, 2)


async def test_a_spans_key_sent_again_with_one_span_more_is_a_409_and_writes_nothing(
    admin: httpx.AsyncClient,
) -> None:
    started = await admin.post("/rollouts/start", json={"input": "q", "worker_id": "w"})
    rid = started.json()["rollout"]["rollout_id"]
    key = {"Idempotency-Key": "spans-1"}
    spans = [{"name": "tool", "attributes": {"i": 1}}, {"name": "tool", "attributes": {"i": 2}}]
    first = await admin.post(f"/rollouts/{rid}/spans", json={"spans": spans}, headers=key)
    assert first.status_code == 201
    again = await admin.post(f"/rollouts/{rid}/spans", json={"spans": spans}, headers=key)
    assert again.status_code == 201 and again.json() == first.json()
    for other in ([*spans, {"name": "tool"}], spans[:1], [spans[0], {"name": "tool", "attributes": {"i": 3}}]):
        refused = error(await admin.post(f"/rollouts/{rid}/spans", json={"spans": other}, headers=key), 409)
        assert "'spans-1' was already used for a different request" in refused["message"]
    stored = (await admin.get(f"/rollouts/{rid}/spans")).json()["items"]
    assert [(s["span_id"], s["sequence_id"]) for s in stored] == [
        (s["span_id"], s["sequence_id"]) for s in first.json()["spans"]
    ]


ALLOWED = "may only hold letters, digits and - _ . : ~ @ + ="


@pytest.mark.parametrize(
    ("path", "body", "param", "says"),
    [
        ("/rollouts", {"tasks": [{"input": 1, "rollout_id": "team/run-1"}]}, "tasks.0.rollout_id", ALLOWED),
        ("/rollouts", {"tasks": [{"input": 1, "rollout_id": "run 1"}]}, "tasks.0.rollout_id", ALLOWED),
        ("/rollouts", {"tasks": [{"input": 1, "rollout_id": "run?1"}]}, "tasks.0.rollout_id", ALLOWED),
        ("/rollouts", {"tasks": [{"input": 1, "rollout_id": "run%2F1"}]}, "tasks.0.rollout_id", ALLOWED),
        ("/rollouts", {"tasks": [{"input": 1, "rollout_id": ".."}]}, "tasks.0.rollout_id", "'.' or '..'"),
        ("/rollouts", {"tasks": [{"input": 1, "group_id": "g/1", "group_size": 2}]}, "tasks.0.group_id", ALLOWED),
        ("/rollouts/start", {"input": 1, "rollout_id": "a/b"}, "rollout_id", ALLOWED),
        ("/rollouts/start", {"input": 1, "group_id": "a#b"}, "group_id", ALLOWED),
    ],
)
async def test_client_ids_a_url_path_cannot_carry_are_a_400_naming_the_allowed_characters(
    admin: httpx.AsyncClient, path: str, body: dict[str, Any], param: str, says: str
) -> None:
    refused = error(await admin.post(path, json=body), 400)
    assert refused["param"] == param and refused["type"] == "invalid_request_error"
    assert says in refused["message"]
    assert (await admin.get("/rollouts")).json()["items"] == []


async def test_client_ids_with_the_allowed_characters_are_addressable_everywhere(
    gw: RunningGateway, admin: httpx.AsyncClient, mock: MockBackendProcess
) -> None:
    await gw.store.put_model("policy", [vllm(mock)])
    rid, group = "team:run~7@v2+lr=0.1_é", "grp:1~x@y+z=w.é"
    queued = await admin.post("/rollouts", json={"tasks": [{"input": "q", "rollout_id": rid, "group_id": group}]})
    assert queued.status_code == 201, queued.text
    assert (await admin.get(f"/rollouts/{rid}")).json()["rollout_id"] == rid
    assert [r["rollout_id"] for r in (await admin.get(f"/groups/{group}")).json()["rollouts"]] == [rid]
    [claim] = (await admin.post("/claims", json={"worker_id": "w"})).json()["claims"]
    assert claim["base_url"].endswith(f"/rollout/{rid}/attempt/{claim['attempt']['attempt_id']}/v1")
    async with gw.http(headers={"Authorization": f"Bearer {claim['api_key']}"}) as llm:
        call = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
        answer = await llm.post(f"{claim['base_url']}/chat/completions", json=call)  # the base_url as handed out
    assert answer.status_code == 200, answer.text
    assert (await admin.post(f"/rollouts/{rid}/rewards", json={"value": 1.0})).status_code == 201
    spans = (await admin.get(f"/rollouts/{rid}/spans")).json()["items"]
    assert [s["sequence_id"] for s in spans] == [1, 2]
    assert (await admin.post(f"/rollouts/{rid}/cancel")).json()["status"] == "cancelled"


async def test_updating_a_bundle_that_does_not_exist_is_a_404_and_the_latest_stays(
    gw: RunningGateway, admin: httpx.AsyncClient
) -> None:
    first = (await admin.post("/resources", json={"resources": {"prompt": "p1"}})).json()
    refused = error(await admin.put("/resources/rs-unknown", json={"resources": {"prompt": "p2"}}), 404)
    assert refused["message"] == "resources 'rs-unknown' not found"
    assert (await admin.get("/resources/latest")).json() == first
    assert [r["resources_id"] for r in (await admin.get("/resources")).json()["items"]] == [first["resources_id"]]
    updated = (await admin.put(f"/resources/{first['resources_id']}", json={"resources": {"prompt": "p2"}})).json()
    assert (updated["resources_id"], updated["version"]) == (first["resources_id"], 2)
    # The Agent-lightning route keeps its wire protocol: an update of a new id makes it (version 1).
    async with gw.http("/v1/agl", headers=AUTH) as agl:
        prompt = {"p": {"resource_type": "prompt_template", "template": "t", "engine": "f-string"}}
        made = await agl.post("/resources/agl-new", json=prompt)
    assert made.status_code == 200 and made.json()["version"] == 1
    assert (await admin.get("/resources/latest")).json()["resources_id"] == "agl-new"


async def test_unknown_mode_and_backends_that_are_not_http_urls_are_400s(admin: httpx.AsyncClient) -> None:
    mode = error(await admin.get("/rollouts", params={"mode": "bogus"}), 400)
    assert mode["param"] == "mode" and "'train', 'val' or 'test'" in mode["message"]
    assert (await admin.get("/rollouts", params={"mode": "val"})).status_code == 200
    for url in ("ftp://models.internal/v1", "localhost:8000/v1", "http://", "not a url", "http://[::1"):
        backend = {"backend_id": "b", "base_url": url, "kind": "vllm", "model": "m"}
        refused = error(await admin.put("/models/m", json={"backends": [backend]}), 400)
        assert "base_url must be an http:// or https:// URL" in refused["message"], url
    assert (await admin.get("/models")).json()["items"] == []
    good = {"backend_id": "b", "base_url": "https://[::1]:8000/v1", "kind": "vllm", "model": "m"}
    assert (await admin.put("/models/m", json={"backends": [good]})).status_code == 200


async def test_a_body_that_is_not_a_json_object_is_a_400_saying_so_on_every_admin_route(gw: RunningGateway) -> None:
    paths = gw.app.api.openapi()["paths"]
    with_body = [
        (method.upper(), path.replace("{", "x-").replace("}", ""))
        for path, operations in paths.items()
        if path.startswith("/admin/v1")
        for method, operation in operations.items()
        if "requestBody" in operation
    ]
    assert len(with_body) >= 10
    async with gw.http(headers={**AUTH, "Content-Type": "application/json"}) as client:
        for method, path in with_body:
            refused = error(await client.request(method, path, content=b'{"tasks": [1,}'), 400)
            assert refused["param"] is None, (method, path)
            assert refused["message"] == ("the request body is not valid JSON: Expecting value (at character 13)"), (
                method,
                path,
            )
            for body, got in ((b"[1]", "an array"), (b'"x"', "a string")):
                refused = error(await client.request(method, path, content=body), 400)
                assert refused["message"] == f"the request body must be a JSON object, got {got}", (method, path)


async def test_a_reward_that_is_not_a_number_is_a_400_and_records_nothing(
    gw: RunningGateway, admin: httpx.AsyncClient
) -> None:
    await gw.store.enqueue([{"input": "q", "rollout_id": "ro-reward"}])
    await gw.store.claim("w")
    for value in (True, False, "0.5", "1", [1.0], {"v": 1}):
        refused = error(await admin.post("/rollouts/ro-reward/rewards", json={"value": value}), 400)
        assert refused["type"] == "invalid_request_error" and "value" in refused["message"], refused
    assert (await admin.get("/rollouts/ro-reward/spans")).json()["items"] == []
    for number in (1, 0.25, None):  # an integer, a float, null: a number (or no reward)
        written = await admin.post("/rollouts/ro-reward/rewards", json={"value": number})
        assert written.status_code == 201, written.text
    spans = (await admin.get("/rollouts/ro-reward/spans")).json()["items"]
    assert [s["attributes"]["rollway.reward.value"] for s in spans] == [1.0, 0.25, None]


@pytest.mark.in_process(False)
async def test_a_cancelled_rollouts_attempt_takes_no_heartbeat_and_no_outcome(
    gw: RunningGateway, admin: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    """After a cancel, the runner's heartbeat and its late outcome are 409s in the envelope (one by one and in a
    batch): the attempt stays ``preparing``, the rollout ``cancelled``, and nothing is logged as a failure."""
    started = (await admin.post("/rollouts/start", json={"input": "q", "worker_id": "w"})).json()
    rid, aid = started["rollout"]["rollout_id"], started["attempt"]["attempt_id"]
    assert (await admin.post(f"/rollouts/{rid}/cancel")).json()["status"] == "cancelled"
    refused = error(await admin.post(f"/rollouts/{rid}/attempts/{aid}/heartbeat"), 409)
    assert refused["type"] == "conflict_error" and "'cancelled'" in refused["message"]
    for outcome in ("succeeded", "failed"):
        refused = error(await admin.patch(f"/rollouts/{rid}/attempts/{aid}", json={"status": outcome}), 409)
        moving = f"cannot move from 'preparing' to '{outcome}'"
        assert refused["message"] == f"the rollout is 'cancelled': its attempt {moving}"
    change = {"rollout_id": rid, "attempt_id": aid, "status": "succeeded", "reward": 1.0}
    (result,) = (await admin.patch("/attempts", json={"updates": [change]})).json()["results"]
    assert result["status"] == 409 and result["error"]["error"]["type"] == "conflict_error"
    attempt = await gw.store.get_attempt(rid, aid)
    assert attempt.status == "preparing" and attempt.end_time is None
    assert (await admin.get(f"/rollouts/{rid}")).json()["status"] == "cancelled"
    assert await gw.store.query_spans(rid) == []  # the batch's reward went with its refused outcome
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


@pytest.mark.in_process(False)
async def test_a_request_without_its_credential_is_a_401_whatever_its_body(gw: RunningGateway) -> None:
    """FastAPI reads a body before it runs a route's auth: a caller without a credential learnt whether its body
    parsed (400) before it was told it may not ask. Every route that takes a body behind the admin token — the
    admin API, Agent-lightning's, the Osmosis callback — answers 401 first, whatever the body; with the credential,
    the body's 400 and the callback's 403 (a rollout key of another rollout) come as before."""
    paths = gw.app.api.openapi()["paths"]
    with_body = [
        (method.upper(), path.replace("{", "x-").replace("}", ""))
        for path, operations in paths.items()
        if path.startswith(("/admin/v1", "/v1/agl", "/v1/rollout"))
        for method, operation in operations.items()
        if "requestBody" in operation
    ]
    assert ("POST", "/v1/rollout/completed") in with_body and ("POST", "/v1/agl/rollouts/search") in with_body
    json_type = {"Content-Type": "application/json"}
    async with gw.http(headers=json_type) as anonymous:
        for method, path in with_body:
            for body in (b"{", b"[1]", b"{}", b'{"rollout_id": 5, "limit": "x"}'):
                refused = error(await anonymous.request(method, path, content=body), 401)
                assert refused["type"] == "authentication_error", (method, path, body)
    async with gw.http(headers={**AUTH, **json_type}) as admin:
        broken = error(await admin.post("/v1/rollout/completed", content=b'{"rollout_id": '), 400)
        assert broken["message"] == "the request body is not valid JSON: Expecting value (at character 15)"
        assert error(await admin.post("/v1/rollout/completed", json={"status": "COMPLETED"}), 400)["param"]
        keyed = (await admin.post("/admin/v1/rollouts/start", json={"input": "q"})).json()
        other = (await admin.post("/admin/v1/rollouts/start", json={"input": "r"})).json()
    report = {"rollout_id": other["rollout"]["rollout_id"], "status": "COMPLETED"}
    rollout_key = {"Authorization": f"Bearer {keyed['api_key']}"}
    async with gw.http(headers=rollout_key) as agent:
        assert error(await agent.post("/v1/rollout/completed", json=report), 403)["type"] == "permission_error"
        assert error(await agent.post("/v1/rollout/completed", content=b"{", headers=json_type), 400)


@pytest.mark.in_process(False)
async def test_a_number_that_is_not_finite_in_a_tasks_input_or_metadata_is_a_400_and_nothing_is_stored(
    gw: RunningGateway, admin: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    """Python's JSON parser reads ``NaN``, ``Infinity`` and ``1e999``, which JSON has not and the store would keep
    as null: refused on every admin route that takes a task's input or metadata, as rewards are."""
    json_type = {"Content-Type": "application/json"}
    bodies = {
        "/rollouts": [
            b'{"tasks": [{"input": {"q": NaN}}]}',
            b'{"tasks": [{"input": "a"}, {"input": [1, 1e999]}]}',
            b'{"tasks": [{"input": "a", "metadata": {"w": -Infinity}}]}',
            b'{"tasks": [{"input": "a", "config": {"timeout_seconds": Infinity}}]}',
        ],
        "/rollouts/start": [b'{"input": NaN}', b'{"input": "a", "metadata": {"w": Infinity}}'],
    }
    for path, sent in bodies.items():
        for body in sent:
            refused = error(await admin.post(path, content=body, headers=json_type), 400)
            assert "finite" in refused["message"], (path, body)
    assert (await admin.get("/rollouts")).json()["items"] == []
    started = (await admin.post("/rollouts/start", json={"input": "q"})).json()
    rid, aid = started["rollout"]["rollout_id"], started["attempt"]["attempt_id"]
    patch = b'{"status": "succeeded", "metadata": {"score": NaN}}'
    refused = error(await admin.patch(f"/rollouts/{rid}/attempts/{aid}", content=patch, headers=json_type), 400)
    assert refused["message"] == "attempt metadata holds NaN: a JSON number must be finite"
    batch = f'{{"updates": [{{"rollout_id": "{rid}", "attempt_id": "{aid}", "metadata": {{"s": Infinity}}}}]}}'
    (result,) = (await admin.patch("/attempts", content=batch.encode(), headers=json_type)).json()["results"]
    assert result["status"] == 400
    attempt = await gw.store.get_attempt(rid, aid)
    assert (attempt.status, attempt.metadata) == ("preparing", None)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
