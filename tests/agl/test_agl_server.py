"""Agent-lightning 1.0's server API at the root (``rollway.agl.server``, ``gateway.controlled``), against a real
uvicorn and the mock backend: the rollouts' four-state view and its transition table, the terminal log and its
cursor, events raw and as triplets, the proxy (model forced, per-mode parameters, pause with ``Retry-After``,
the drain to ``inflight == 0``, streams recorded with exact ids), auth, and a restart that loses nothing. The
pause's tests, which aliases it holds and its resume resumes among them, run on SQLite and PostgreSQL.
The real Agent-lightning 1.0.2 clients drive it in ``test_agl1_clients.py``."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollway.mock import MockBackendProcess
from rollway.store import UnavailableError
from rollway.store.controlled import EngineModel
from support.gateway_harness import RunningGateway, replay, running_gateway, sse_events

TOKEN = "agl1-server-token"
MODEL = "/models/policy"  # a trainer names its model by its path: not a usable alias as it is
AUTH = {"x-api-key": TOKEN}


def proxy_path(rollout_id: str, mode: str = "train", op: str = "chat/completions", attempt: str = "0") -> str:
    return f"/proxy/rollout/{rollout_id}/attempt/{attempt}/mode/{mode}/openai/v1/{op}"


async def registered(gw: RunningGateway, mock: MockBackendProcess, version: int = 0) -> httpx.AsyncClient:
    client = gw.http(headers=AUTH, timeout=30)
    answer = await client.post("/api/models", json=[{"model": MODEL, "endpoint": mock.base_url, "version": version}])
    assert answer.status_code == 201, answer.text
    return client


async def running(client: httpx.AsyncClient, *inputs: Any) -> list[str]:
    ids = [f"ro{i}-{time.monotonic_ns()}" for i in range(len(inputs))]
    made = await client.post(
        "/api/rollouts", json=[{"input": x, "rollout_id": r} for x, r in zip(inputs, ids, strict=True)]
    )
    assert made.status_code == 201, made.text
    for rid in ids:
        moved = await client.patch(
            f"/api/rollouts/{rid}", json={"status": {"state": "running", "last_attempt_id": "0"}}
        )
        assert moved.status_code == 200, moved.text
    return ids


def ask(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "auto", "messages": [{"role": "user", "content": text}], **extra}


async def test_rollouts_follow_the_four_state_table_and_its_409s(tmp_path: Path, mock: MockBackendProcess) -> None:
    async with running_gateway(tmp_path, admin_token=TOKEN) as gw, gw.http(headers=AUTH, timeout=30) as client:
        made = await client.post(
            "/api/rollouts",
            json=[
                {"input": {"data_id": "d1"}, "rollout_id": "a", "metadata": {"batch_idx": 3, "extra": "kept"}},
                {"input": {"instance_id": "i2"}, "is_train": False, "config": {"local": {"agent_class": "m.A"}}},
            ],
        )
        assert made.status_code == 201
        first, second = made.json()
        assert first["status"] | {"created_at": 0, "updated_at": 0} == {
            "state": "queuing",
            "k8s_job_name": None,
            "last_attempt_id": None,
            "error_message": None,
            "version": 1,
            "created_at": 0,
            "updated_at": 0,
        }
        assert first["metadata"] == {"batch_idx": 3, "sample_idx_in_batch": None, "extra": "kept"}
        assert second["config"] == {
            "timeout_seconds": 3600,
            "local": {"agent_class": "m.A", "env_map": {}},
            "k8s": None,
        }
        assert len(second["rollout_id"]) == 32 and not second["is_train"]

        # Idempotent per id: the stored rollout comes back unchanged, even once it runs.
        await client.patch("/api/rollouts/a", json={"status": {"state": "running", "last_attempt_id": "0"}})
        again = (await client.post("/api/rollouts", json=[{"input": "other", "rollout_id": "a"}])).json()
        assert again[0]["input"] == {"data_id": "d1"} and again[0]["status"]["state"] == "running"
        assert again[0]["status"]["version"] == 2

        listed = await client.get("/api/rollouts", params={"state_in": ["queuing", "running"]})
        assert [r["rollout_id"] for r in listed.json()] == ["a", second["rollout_id"]]
        assert (await client.get("/api/rollouts", params={"state_in": "running"})).json()[0]["rollout_id"] == "a"
        assert (await client.get("/api/rollouts")).status_code == 422  # state_in is required

        # running → running, → queuing and terminal → anything are refused; a queuing rollout may fail at once.
        for state in ("running", "queuing"):
            refused = await client.patch("/api/rollouts/a", json={"status": {"state": state}})
            assert refused.status_code == 409 and "cannot transition running" in refused.json()["detail"]
        failed = await client.patch(
            f"/api/rollouts/{second['rollout_id']}", json={"status": {"state": "failed", "error_message": "no pod"}}
        )
        assert failed.json()["status"] | {"updated_at": 0} == second["status"] | {
            "state": "failed",
            "error_message": "no pod",
            "version": 2,
            "updated_at": 0,
        }
        done = await client.patch("/api/rollouts/a", json={"status": {"state": "succeeded"}})
        assert (
            done.json()["status"]["state"] == "succeeded" and done.json()["status"]["version"] == 3
        )  # refusals change nothing
        assert (await client.patch("/api/rollouts/a", json={"status": {"state": "failed"}})).status_code == 409
        # A field-only change moves the version; an empty one changes nothing; unknown fields and states are 422.
        job = await client.patch("/api/rollouts/a", json={"status": {"k8s_job_name": "job-1"}})
        assert job.json()["status"]["version"] == 4 and job.json()["status"]["k8s_job_name"] == "job-1"
        assert (await client.patch("/api/rollouts/a", json={})).json()["status"]["version"] == 4
        assert (await client.patch("/api/rollouts/a", json={"status": {"bogus": 1}})).status_code == 422
        assert (await client.patch("/api/rollouts/a", json={"status": {"state": "done"}})).status_code == 422
        assert (await client.patch("/api/rollouts/nope", json={"status": {"state": "failed"}})).status_code == 404

        # Rollway's own view of them: statuses of its table, the controller's attempt, and out of runners' reach.
        ours = await gw.store.get_rollout("a", with_attempts=True)
        assert ours.status == "succeeded" and ours.agent == "agl:controller" and ours.mode == "train"
        assert [a.status for a in ours.attempts or []] == ["succeeded"]
        assert await gw.store.claim("runner") == []
        # Deleted: gone from this API (404, and idempotent), kept for the admin API.
        assert (await client.delete("/api/rollouts/a")).status_code == 204
        assert (await client.delete("/api/rollouts/a")).status_code == 204
        assert (await client.get("/api/rollouts/a")).status_code == 404
        assert (await gw.store.get_rollout("a")).status == "succeeded"
        assert (await client.post("/api/rollouts", json=[{"input": 1, "rollout_id": "a"}])).status_code == 409


async def test_the_terminal_log_counts_in_completion_order_and_skips_deleted(
    tmp_path: Path, mock: MockBackendProcess
) -> None:
    async with running_gateway(tmp_path, admin_token=TOKEN) as gw, gw.http(headers=AUTH, timeout=30) as client:
        made = await client.post("/api/rollouts", json=[{"input": {"data_id": f"d{i}"}} for i in range(5)])
        ids = [r["rollout_id"] for r in made.json()]
        assert (await client.get("/api/rollouts/terminal")).json() == {
            "items": [],
            "next_after": 0,
            "total_terminal": 0,
        }
        for rid in ids[:4]:
            await client.patch(f"/api/rollouts/{rid}", json={"status": {"state": "running"}})
        order = [ids[2], ids[0], ids[3], ids[1]]  # the order they end, not the order they were made
        for n, rid in enumerate(order):
            await client.patch(f"/api/rollouts/{rid}", json={"status": {"state": "succeeded" if n % 2 else "failed"}})
        page = (await client.get("/api/rollouts/terminal", params={"limit": 3})).json()
        assert [i["rollout_id"] for i in page["items"]] == order[:3]
        assert page["items"][0] == {"rollout_id": ids[2], "state": "failed", "data_id": "d2", "is_train": True}
        assert page["next_after"] == 3 and page["total_terminal"] == 4
        await client.delete(f"/api/rollouts/{order[3]}")  # deleted: still counted, not listed
        rest = (await client.get("/api/rollouts/terminal", params={"after": 3})).json()
        assert rest == {"items": [], "next_after": 4, "total_terminal": 4}
        assert (await client.get("/api/rollouts/terminal", params={"after": 9})).json()["next_after"] == 9
        # A position or limit past the database's 64-bit integers is past the log's end, or all of it.
        beyond = (await client.get("/api/rollouts/terminal", params={"after": 2**70, "limit": 2**70})).json()
        assert beyond == {"items": [], "next_after": 2**63 - 1, "total_terminal": 4}
        listed = await client.get("/api/rollouts", params={"state_in": "succeeded", "limit": 2**70})
        assert [r["rollout_id"] for r in listed.json()] == [order[1]]
        # A reward written after the end leaves the rollout where it was in the log.
        await client.post(
            f"/api/rollouts/{order[0]}/attempt/0/events", json={"event_type": "reward", "data": {"value": 1}}
        )
        await client.patch(f"/api/rollouts/{ids[4]}", json={"status": {"state": "failed"}})
        log = (await client.get("/api/rollouts/terminal", params={"after": -5})).json()
        assert [i["rollout_id"] for i in log["items"]] == [*order[:3], ids[4]] and log["total_terminal"] == 5


async def test_events_are_the_calls_and_posted_events_with_the_triplet_view(
    tmp_path: Path, mock: MockBackendProcess
) -> None:
    async with running_gateway(tmp_path, admin_token=TOKEN) as gw:
        client = await registered(gw, mock, version=7)
        early = (await client.post("/api/rollouts", json=[{"input": 1, "rollout_id": "ev"}])).json()[0]
        posted = await client.post("/api/rollouts/ev/attempt/0/events", json={"event_type": "note", "data": {"n": 0}})
        assert posted.json()["rollout_id"] == "ev" and posted.json()["data"] == {"n": 0}
        assert early["status"]["state"] == "queuing"
        await client.patch("/api/rollouts/ev", json={"status": {"state": "running", "last_attempt_id": "0"}})
        first = await client.post(proxy_path("ev"), json=ask("the same prompt"))
        again = await client.post(proxy_path("ev"), json=ask("the same prompt"))  # the agent's retry
        other = await client.post(proxy_path("ev"), json=ask("another prompt"))
        assert first.status_code == again.status_code == other.status_code == 200
        await client.post("/api/rollouts/ev/attempt/0/events", json={"event_type": "reward", "data": {"value": 0.25}})
        await client.post("/api/rollouts/ev/attempt/9/events", json={"event_type": "reward", "data": {"value": 9}})

        raw = (await client.get("/api/rollouts/ev/events")).json()
        assert [e["event_type"] for e in raw] == ["note", "model_request", "model_request", "model_request", "reward"]
        assert all(e["attempt_id"] == "0" and e["rollout_id"] == "ev" for e in raw)
        call = raw[1]["data"]
        assert call["model"] == MODEL and call["model_version"] == 7 and call["status"] == "ok"
        assert call["server"] == {"model": MODEL, "endpoint": mock.base_url, "version": 7}
        # The body as forwarded: the model forced, the train temperature, token ids and logprobs asked.
        assert call["request"] | {"messages": None} == {
            "model": MODEL,
            "messages": None,
            "temperature": 1.0,
            "return_token_ids": True,
            "logprobs": True,
        }
        assert call["response"] == first.json()  # the engine's answer, as the agent got it
        assert call["http_status"] == 200 and call["usage"] == first.json()["usage"]

        triplets = (await client.get("/api/rollouts/ev/events", params={"format": "triplet"})).json()
        assert [e["event_type"] for e in triplets] == ["note", "model_request", "model_request", "reward"]
        kept = triplets[1]["data"]
        choice = again.json()["choices"][0]
        assert kept["prompt_token_ids"] == again.json()["prompt_token_ids"]  # the last of the same prompt
        assert kept["response_token_ids"] == choice["token_ids"]
        assert kept["response_log_probs"] == [t["logprob"] for t in choice["logprobs"]["content"]]
        assert triplets[3]["data"] == {"value": 0.25}
        rewards = (await client.get("/api/rollouts/ev/events", params={"event_type": "reward"})).json()
        assert [r["data"]["value"] for r in rewards] == [0.25]
        # Posted model_request events are kept as posted, and deduplicated with the calls in the triplet view.
        for token in (30, 31):
            response = {"prompt_token_ids": [1, 2], "choices": [{"token_ids": [token]}]}
            await client.post(
                "/api/rollouts/ev/attempt/0/events",
                json={"event_type": "model_request", "data": {"response": response}},
            )
        posted = (await client.get("/api/rollouts/ev/events", params={"format": "triplet"})).json()[-1]["data"]
        assert posted["prompt_token_ids"] == [1, 2] and posted["response_token_ids"] == [31]
        assert len((await client.get("/api/rollouts/ev/events", params={"format": "triplet"})).json()) == 5
        detail = (await client.get("/api/rollouts/ev")).json()
        assert detail["attempts"] == ["0", "9"] and detail["rollout"]["rollout_id"] == "ev"
        # The events are Rollway's spans too: its exports see the calls and the reward.
        spans = await gw.store.query_spans("ev")
        assert [s.sequence_id for s in spans] == [1, 2, 3, 4, 5, 6, 7]
        assert [s.attributes["rollway.reward.value"] for s in spans if s.name == "rollway.reward"] == [0.25, 9.0]
        await client.aclose()


async def test_the_proxy_checks_in_order_and_answers_as_the_mode_says(tmp_path: Path, mock: MockBackendProcess) -> None:
    async with running_gateway(tmp_path, admin_token=TOKEN, agl_val_temperature=0.2) as gw:
        async with gw.http(timeout=30) as anonymous:
            assert (await anonymous.post(proxy_path("x"), json=ask("hi"))).status_code == 401
            assert (await anonymous.get("/api/rollouts", params={"state_in": "queuing"})).status_code == 401
            assert (await anonymous.get("/healthz")).json() == {"status": "ok"}
        client = gw.http(headers={"authorization": f"Bearer {TOKEN}"}, timeout=30)
        [rid] = await running(client, {"q": 1})
        assert (await client.post(proxy_path(rid), json=ask("hi"))).status_code == 503  # no model registered
        await (await registered(gw, mock)).aclose()
        assert (await client.post(proxy_path(rid, mode="test"), json=ask("hi"))).status_code == 404
        assert (await client.post(proxy_path(rid, op="embeddings"), json=ask("hi"))).status_code == 404
        assert (await client.post(proxy_path("missing"), json=ask("hi"))).status_code == 404
        # A rollout its controller has not started, or one that ended, takes no calls (agl-server forwards them).
        await client.post("/api/rollouts", json=[{"input": 1, "rollout_id": "later"}])
        assert (await client.post(proxy_path("later"), json=ask("hi"))).status_code == 404
        await client.patch("/api/rollouts/later", json={"status": {"state": "failed"}})
        assert (await client.post(proxy_path("later"), json=ask("hi"))).status_code == 409
        bad = await client.post(proxy_path(rid), content=b"{nope", headers={"content-type": "application/json"})
        assert bad.status_code == 400
        assert (await client.post(proxy_path(rid), json=[1])).status_code == 400
        val = await client.post(proxy_path(rid, mode="val"), json=ask("hi", temperature=1.5, logprobs=False))
        text = await client.post(
            proxy_path(rid, op="completions"), json={"model": "x", "prompt": "hello", "max_tokens": 4}
        )
        assert val.status_code == 200 and text.status_code == 200, text.text
        sent = mock.requests(limit=2)
        assert sent[0]["body"]["temperature"] == 0.2  # the val temperature, whatever the agent asked
        assert val.json()["choices"][0]["logprobs"] is None  # as the agent asked (the span still has them)
        assert sent[1]["body"]["logprobs"] == 1 and sent[1]["body"]["model"] == MODEL  # the integer vLLM wants
        assert text.json()["choices"][0]["logprobs"]["token_logprobs"]
        assert val.headers["x-rollway-rollout-id"] == rid
        await client.aclose()


async def test_pause_refuses_with_retry_after_drains_and_resumes(
    tmp_path: Path, mock: MockBackendProcess, store_url: str
) -> None:
    async with running_gateway(tmp_path, database_url=store_url, admin_token=TOKEN) as gw:
        client = await registered(gw, mock)
        [rid] = await running(client, {"q": 1})
        mock.add_faults({"kind": "delay", "ms": 1500})
        slow = asyncio.create_task(client.post(proxy_path(rid), json=ask("slow")))
        await _until(client, lambda s: s["inflight"] == 1)
        paused = await client.post("/proxy/pause", json={"retry_after_seconds": 7, "reason": "weight sync"})
        assert paused.json() == {"paused": True, "retry_after_seconds": 7, "reason": "weight sync", "inflight": 1}
        refused = await client.post(proxy_path(rid), json=ask("during the pause"))
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "7" and refused.headers["x-agl-paused"] == "true"
        await _until(client, lambda s: s["inflight"] == 0)  # the trainer's drain
        assert (await slow).status_code == 200
        # The trainer re-registers its models with the new version while paused, then resumes.
        await client.delete("/api/models")
        await client.post("/api/models", json=[{"model": MODEL, "endpoint": mock.base_url, "version": 1}])
        resumed = (await client.post("/proxy/resume")).json()
        assert resumed == {"paused": False, "retry_after_seconds": 7, "reason": None, "inflight": 0}
        after = await client.post(proxy_path(rid), json=ask("after"))
        assert after.status_code == 200
        events = (await client.get(f"/api/rollouts/{rid}/events")).json()
        assert [e["data"]["model_version"] for e in events] == [0, 1]  # the refused call is no event
        await client.aclose()


async def _until(client: httpx.AsyncClient, ready: Any, timeout: float = 20.0) -> dict[str, Any]:
    """Poll ``/proxy/state`` (as the trainer does, every 0.05 s here) until ``ready`` holds."""
    deadline = time.monotonic() + timeout
    while True:
        state: dict[str, Any] = (await client.get("/proxy/state")).json()
        if ready(state):
            return state
        assert time.monotonic() < deadline, state
        await asyncio.sleep(0.05)


async def test_a_streamed_proxy_call_is_recorded_with_the_engines_ids(tmp_path: Path, mock: MockBackendProcess) -> None:
    async with running_gateway(tmp_path, admin_token=TOKEN) as gw:
        client = await registered(gw, mock)
        [rid] = await running(client, {"q": 1})
        streamed = await client.post(proxy_path(rid), json=ask("stream this", stream=True))
        assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
        chunks = [data for _, data in sse_events(streamed.text) if isinstance(data, dict)]
        assert chunks and sse_events(streamed.text)[-1][1] == "[DONE]"
        [event] = (await client.get(f"/api/rollouts/{rid}/events", params={"format": "triplet"})).json()
        direct = await replay(mock, ask("stream this", model=MODEL, temperature=1.0))
        assert event["data"]["prompt_token_ids"] == direct["prompt_token_ids"]
        assert event["data"]["response_token_ids"] == direct["choices"][0]["token_ids"]
        assert event["data"]["response_log_probs"] == [
            t["logprob"] for t in direct["choices"][0]["logprobs"]["content"]
        ]
        await client.aclose()


async def test_a_restart_loses_no_rollout_event_model_or_pause(
    tmp_path: Path, mock: MockBackendProcess, store_url: str
) -> None:
    async with running_gateway(tmp_path, database_url=store_url, admin_token=TOKEN) as gw:
        client = await registered(gw, mock, version=4)
        [done, live] = await running(client, {"q": 1}, {"q": 2})
        await client.post(proxy_path(done), json=ask("before the restart"))
        await client.post(f"/api/rollouts/{done}/attempt/0/events", json={"event_type": "reward", "data": {"value": 1}})
        await client.patch(f"/api/rollouts/{done}", json={"status": {"state": "succeeded"}})
        await client.post("/proxy/pause", json={"reason": "sync"})
        before = (await client.get(f"/api/rollouts/{done}/events")).json()
        await client.aclose()
    async with running_gateway(tmp_path, database_url=store_url, admin_token=TOKEN) as gw:
        client = gw.http(headers=AUTH, timeout=30)
        assert (await client.get(f"/api/rollouts/{done}/events")).json() == before
        assert (await client.get("/api/rollouts/terminal")).json()["items"][0]["rollout_id"] == done
        assert (await client.get("/proxy/state")).json()["paused"] is True
        assert (await client.post(proxy_path(live), json=ask("paused"))).status_code == 429
        await client.post("/proxy/resume")
        after = await client.post(proxy_path(live), json=ask("after the restart"))
        assert after.status_code == 200  # the model registered before the restart serves it
        await client.patch(f"/api/rollouts/{live}", json={"status": {"state": "succeeded"}})
        events = (await client.get(f"/api/rollouts/{live}/events")).json()
        assert events[0]["data"]["server"]["version"] == 4
        await client.aclose()


async def test_the_proxy_takes_an_admin_key_as_the_api_routes_do(tmp_path: Path, mock: MockBackendProcess) -> None:
    async with running_gateway(tmp_path, admin_token=TOKEN) as gw:
        await (await registered(gw, mock)).aclose()
        async with gw.http(headers={"authorization": f"Bearer {TOKEN}"}, timeout=30) as admin:
            [rid] = await running(admin, {"q": 1})
            minted = (await admin.post("/admin/v1/keys", json={"scope": "admin"})).json()
            other = (await admin.post("/admin/v1/keys", json={"scope": "gateway"})).json()
        for headers in ({"x-api-key": minted["key"]}, {"authorization": f"Bearer {minted['key']}"}):
            async with gw.http(headers=headers, timeout=30) as client:
                assert (await client.get(f"/api/rollouts/{rid}")).status_code == 200
                assert (await client.post(proxy_path(rid), json=ask("hi"))).status_code == 200
        # Any other key is refused on both, the proxy's answer in OpenAI's envelope.
        async with gw.http(headers={"x-api-key": other["key"]}, timeout=30) as client:
            assert (await client.get(f"/api/rollouts/{rid}")).status_code == 401
            refused = await client.post(proxy_path(rid), json=ask("hi"))
            assert refused.status_code == 401 and refused.json()["error"]["message"] == "Invalid or missing API key"


async def test_a_paused_state_counts_a_replica_not_heard_from_since_the_pause(
    tmp_path: Path, mock: MockBackendProcess, monkeypatch: pytest.MonkeyPatch, store_url: str
) -> None:
    """Two processes on one database: while the other one has not reported since the pause (it may hold a call
    that read the catalog before it), or the reports cannot be read, ``inflight`` is not 0, so the trainer's drain
    does not end on a count that predates the pause."""
    async with (
        running_gateway(tmp_path, database_url=store_url, admin_token=TOKEN) as gw,
        running_gateway(tmp_path, database_url=store_url, admin_token=TOKEN) as peer,
    ):
        client = await registered(gw, mock)

        ticked = asyncio.Event()

        async def silent() -> None:  # the peer's reporter writes nothing more (a slow or stalled process)
            ticked.set()

        monkeypatch.setattr(peer.state.reporter, "tick", silent)
        # Its loop runs one tick at a time: once it has called the silent one, a real tick it was in (which could
        # still write a report, read after the pause) has ended.
        await asyncio.wait_for(ticked.wait(), 10)
        await client.post("/proxy/pause", json={"reason": "weight sync"})
        for _ in range(5):  # across the peer's next ticks, each one silent
            ticked.clear()
            await asyncio.wait_for(ticked.wait(), 10)
            assert (await client.get("/proxy/state")).json()["inflight"] >= 1
        monkeypatch.undo()
        await _until(client, lambda s: s["inflight"] == 0)  # its report written after the pause says none

        async def unreadable(*, exclude: str | None = None) -> list[Any]:
            raise UnavailableError("the database is locked")

        monkeypatch.setattr(gw.store, "live_replicas", unreadable)
        assert (await client.get("/proxy/state")).json()["inflight"] >= 1
        await client.post("/proxy/resume")
        assert (await client.get("/proxy/state")).json()["inflight"] == 0  # not paused: nothing waits on it
        await client.aclose()


async def test_a_refused_model_registration_changes_nothing_and_answers_detail(
    tmp_path: Path, mock: MockBackendProcess
) -> None:
    async with running_gateway(tmp_path, admin_token=TOKEN) as gw:
        client = await registered(gw, mock, version=3)
        [rid] = await running(client, {"q": 1})
        aliases = await gw.store.list_models()
        # A URL no call could reach (here one holding a password) beside a good update: neither is applied.
        bad = [
            {"model": MODEL, "endpoint": mock.base_url, "version": 4},
            {"model": "other", "endpoint": "http://user:secret@127.0.0.1:9/v1"},
        ]
        for body in (bad, [{"model": "third", "endpoint": "ftp://127.0.0.1/v1"}]):
            refused = await client.post("/api/models", json=body)
            assert refused.status_code == 422, refused.text
            [error] = refused.json()["detail"]
            assert error["loc"] == ["body"] and "base_url" in error["msg"] and "secret" not in refused.text
        assert await gw.store.engine_models() == [EngineModel(model=MODEL, endpoint=mock.base_url, version=3)]
        assert await gw.store.list_models() == aliases
        assert (await client.post(proxy_path(rid), json=ask("hi"))).status_code == 200
        [event] = (await client.get(f"/api/rollouts/{rid}/events")).json()
        assert event["data"]["model_version"] == 3
        await client.aclose()


async def test_resume_leaves_paused_an_alias_an_admin_paused_before(
    tmp_path: Path, mock: MockBackendProcess, store_url: str
) -> None:
    """``/proxy/resume`` resumes the aliases ``/proxy/pause`` paused, and no other: one an admin had paused through
    ``/admin/v1`` stays paused, even when the trainer's pause is sent twice (its client retries any failure)."""
    async with running_gateway(tmp_path, database_url=store_url, admin_token=TOKEN, agl_model=MODEL) as gw:
        client = await registered(gw, mock)
        await client.post("/api/models", json=[{"model": "held", "endpoint": mock.base_url}])
        [policy] = [m.alias for m in await gw.store.list_models() if m.alias != "held"]
        admin = gw.http(headers={"authorization": f"Bearer {TOKEN}"}, timeout=30)
        assert (await admin.post("/admin/v1/models/held/pause")).status_code == 200
        for _ in range(2):
            assert (await client.post("/proxy/pause", json={"reason": "sync"})).json()["paused"] is True
        assert [m.paused for m in await gw.store.list_models()] == [True, True]
        assert (await client.post("/proxy/resume")).json()["paused"] is False
        assert {m.alias: m.paused for m in await gw.store.list_models()} == {policy: False, "held": True}
        [rid] = await running(client, {"q": 1})
        assert (await client.post(proxy_path(rid), json=ask("after"))).status_code == 200
        await admin.aclose()
        await client.aclose()


@contextlib.asynccontextmanager
async def paused_gateway(
    tmp_path: Path, store_url: str
) -> AsyncIterator[tuple[RunningGateway, httpx.AsyncClient, httpx.AsyncClient]]:
    """A gateway whose held calls are refused at once (``pause_wait_seconds: 0``), with the trainer's client (the
    Agent-lightning routes) and an operator's (the admin API)."""
    settings: dict[str, Any] = {"admin_token": TOKEN, "agl_model": MODEL, "pause_wait_seconds": 0}
    async with (
        running_gateway(tmp_path, database_url=store_url, **settings) as gw,
        gw.http(headers=AUTH, timeout=30) as client,
        gw.http(headers={"authorization": f"Bearer {TOKEN}"}, timeout=30) as admin,
    ):
        yield gw, client, admin


async def v1_status(gw: RunningGateway, alias: str) -> int:
    """The status of a ``/v1`` call to ``alias`` (with ``pause_wait_seconds=0``, a paused alias's 429 at once)."""
    async with gw.http(timeout=30) as llm:
        answer = await llm.post("/v1/chat/completions", json=ask("direct", model=alias))
    if answer.status_code == 429:
        assert answer.json()["error"]["code"] == "model_paused", answer.text
    return answer.status_code


async def test_a_registered_models_alias_is_held_whenever_it_is_registered_or_created(
    tmp_path: Path, mock: MockBackendProcess, store_url: str
) -> None:
    """While the proxy is paused a trainer is changing weights, so a registered model's alias that appears
    meanwhile (made again through the admin API, or a new model's), a model registered again whose alias the pause
    did not hold, and an admin's alias that becomes a registered model's (from then on, not before) are held like
    the others: their ``/v1`` calls wait (refused at once here), and ``/proxy/resume`` resumes them."""
    async with paused_gateway(tmp_path, store_url) as (gw, client, admin):
        await client.post("/api/models", json=[{"model": MODEL, "endpoint": mock.base_url}])
        await client.post("/api/models", json=[{"model": "again", "endpoint": mock.base_url}])
        await client.delete("/api/models")  # the aliases stay, not registered: the pause does not hold "again"
        await client.post("/api/models", json=[{"model": MODEL, "endpoint": mock.base_url}])
        [policy] = [m.alias for m in await gw.store.list_models() if m.alias != "again"]
        assert (await client.post("/proxy/pause", json={"reason": "sync"})).status_code == 200
        assert await v1_status(gw, policy) == 429 and await v1_status(gw, "again") == 200

        # The pause's own alias deleted and made again through the admin API: still the registered model's.
        [backend] = [b.model_dump(mode="json") for b in (await gw.store.get_model(policy)).backends]
        assert (await admin.delete(f"/admin/v1/models/{policy}")).status_code == 204
        assert (await admin.put(f"/admin/v1/models/{policy}", json={"backends": [backend]})).status_code == 200
        # An admin's alias made during the pause runs until a model it serves is registered.
        scorer = {"backend_id": "scorer", "base_url": mock.base_url, "model": "scorer"}
        assert (await admin.put("/admin/v1/models/scorer", json={"backends": [scorer]})).status_code == 200
        assert await v1_status(gw, "scorer") == 200
        # A new model, one registered again, and the admin's alias registered as a model.
        endpoints = [{"model": m, "endpoint": mock.base_url} for m in ("fresh", "again", "scorer")]
        assert (await client.post("/api/models", json=endpoints)).status_code == 201
        aliases = [policy, "fresh", "again", "scorer"]
        assert [await v1_status(gw, alias) for alias in aliases] == [429] * 4
        assert {m.alias: m.paused for m in await gw.store.list_models()} == dict.fromkeys(aliases, True)
        assert sorted((await gw.store.proxy_pause()).aliases) == sorted(aliases)

        assert (await client.post("/proxy/resume")).json()["paused"] is False
        assert {m.alias: m.paused for m in await gw.store.list_models()} == dict.fromkeys(aliases, False)
        assert [await v1_status(gw, alias) for alias in aliases] == [200] * 4


async def test_an_alias_of_no_registered_model_is_never_held_by_the_proxy_pause(
    tmp_path: Path, mock: MockBackendProcess, store_url: str
) -> None:
    """An alias put through the admin API that no model registered through ``/api/models`` has (a judge's or a
    scorer's, which a trainer's grader calls during a weight sync) is none of the proxy pause's: made before the
    pause or during it, put again or deleted and made again meanwhile, and with the pause sent again, it takes its
    ``/v1`` calls throughout, and ``/proxy/resume`` leaves it as it is."""
    async with paused_gateway(tmp_path, store_url) as (gw, client, admin):

        async def put(alias: str) -> None:
            backend = {"backend_id": alias, "base_url": mock.base_url, "model": alias}
            answer = await admin.put(f"/admin/v1/models/{alias}", json={"backends": [backend]})
            assert answer.status_code == 200, answer.text

        await client.post("/api/models", json=[{"model": MODEL, "endpoint": mock.base_url}])
        [policy] = [m.alias for m in await gw.store.list_models()]
        await put("judge")
        await put("grader")
        assert (await client.post("/proxy/pause", json={"reason": "sync"})).status_code == 200
        await put("scorer")  # made during the pause
        await put("judge")  # put again during it
        assert (await admin.delete("/admin/v1/models/grader")).status_code == 204
        await put("grader")  # deleted and made again during it
        assert (await client.post("/proxy/pause", json={"reason": "sync"})).status_code == 200  # a retry
        others = ["judge", "grader", "scorer"]
        assert await v1_status(gw, policy) == 429
        assert [await v1_status(gw, alias) for alias in others] == [200] * 3
        paused = {m.alias: m.paused for m in await gw.store.list_models()}
        assert paused == {policy: True} | dict.fromkeys(others, False)
        assert (await gw.store.proxy_pause()).aliases == [policy]

        assert (await client.post("/proxy/resume")).json()["paused"] is False
        assert [await v1_status(gw, alias) for alias in [policy, *others]] == [200] * 4


async def test_resume_leaves_paused_an_alias_an_admin_paused_during_the_pause(
    tmp_path: Path, mock: MockBackendProcess, store_url: str
) -> None:
    """An admin's pause of an alias the proxy's pause already holds makes it the admin's: ``/proxy/resume`` (after
    the trainer's pause sent again) leaves it paused until the admin resumes it."""
    async with paused_gateway(tmp_path, store_url) as (gw, client, admin):
        await client.post("/api/models", json=[{"model": MODEL, "endpoint": mock.base_url}])
        await client.post("/api/models", json=[{"model": "held", "endpoint": mock.base_url}])
        [policy] = [m.alias for m in await gw.store.list_models() if m.alias != "held"]
        assert (await client.post("/proxy/pause", json={"reason": "sync"})).status_code == 200
        assert (await admin.post("/admin/v1/models/held/pause")).status_code == 200
        assert (await client.post("/proxy/pause", json={"reason": "sync"})).status_code == 200  # a retry
        assert (await client.post("/proxy/resume")).json()["paused"] is False
        assert {m.alias: m.paused for m in await gw.store.list_models()} == {policy: False, "held": True}
        assert await v1_status(gw, policy) == 200 and await v1_status(gw, "held") == 429
        assert (await admin.post("/admin/v1/models/held/resume")).status_code == 200
        assert await v1_status(gw, "held") == 200


async def test_a_weight_update_across_the_pause_leaves_its_alias_held_until_the_resume(
    tmp_path: Path, mock: MockBackendProcess, store_url: str
) -> None:
    """A weight update's end gives its alias back the pause it found. One begun before the proxy's pause and ended
    during it leaves the alias to the pause, held until ``/proxy/resume``; one begun during the pause and still
    open at ``/proxy/resume`` resumes the alias when it ends."""
    async with paused_gateway(tmp_path, store_url) as (gw, client, admin):
        await client.post("/api/models", json=[{"model": MODEL, "endpoint": mock.base_url}])
        [policy] = [m.alias for m in await gw.store.list_models()]

        async def begin() -> str:
            begun = await admin.post(f"/admin/v1/models/{policy}/updates", json={"form": "trainer"})
            assert begun.status_code == 201, begun.text
            return str(begun.json()["update_id"])

        async def commit(update_id: str) -> None:
            committed = await admin.post(f"/admin/v1/updates/{update_id}/commit")
            assert committed.status_code == 200, committed.text

        before = await begin()
        assert (await client.post("/proxy/pause", json={"reason": "sync"})).status_code == 200
        await commit(before)
        assert (await gw.store.get_model(policy)).paused and await v1_status(gw, policy) == 429
        assert (await client.post("/proxy/resume")).status_code == 200
        assert await v1_status(gw, policy) == 200

        assert (await client.post("/proxy/pause", json={"reason": "sync"})).status_code == 200
        during = await begin()
        assert (await client.post("/proxy/resume")).status_code == 200
        assert (await gw.store.get_model(policy)).paused  # the update holds it still
        await commit(during)
        assert not (await gw.store.get_model(policy)).paused and await v1_status(gw, policy) == 200
