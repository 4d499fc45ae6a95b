"""Agent-lightning 0.3's own LLM proxy (``LLMProxy``, LiteLLM) with Rollway as its store: the proxy allocates one
sequence id per call when the call arrives and exports every span LiteLLM records for the call under it, over
OTLP to ``/v1/traces``. Rollway keeps sequence ids unique per attempt; the spans that share one get ids of their
own in Rollway's records, and Agent-lightning's routes show them under the id they were sent with, as
Agent-lightning's own store does (its ``LlmProxyTraceToTriplet`` orders calls and matches rewards by it)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollway.mock import MockBackendProcess
from rollway.process import GatewayProcess
from support.agl_env import agl_python, require_agl, run_script

require_agl()  # the whole module skips, with one line, without the Agent-lightning environment

pytestmark = [pytest.mark.real_component, pytest.mark.slow]
TOKEN = "agl-proxy-admin-token-7"
PROXY_ENV = {"LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true"}  # a loopback proxy without a key


def by_sequence(spans: list[list[Any]]) -> list[list[str]]:
    """The span names under each sequence id, in the order of the ids (the order among spans sharing one is by
    time, not compared; the ids' values are each store's own)."""
    out: dict[int, list[str]] = defaultdict(list)
    for name, seq in spans:
        out[seq].append(name)
    return [sorted(out[seq]) for seq in sorted(out)]


def test_agent_lightning_llm_proxy_spans_are_all_kept_under_the_sequence_id_of_their_call(
    tmp_path: Path, mock: MockBackendProcess
) -> None:
    agl_py = agl_python()
    theirs = run_script(agl_py, "llm_proxy.py", "agl", mock.base_url, "2", timeout=150, **PROXY_ENV)
    with GatewayProcess(f"sqlite:///{tmp_path / 'rollway.db'}", admin_token=TOKEN) as server:
        address = f"{server.url}/t/{TOKEN}"
        ours = run_script(agl_py, "llm_proxy.py", address, mock.base_url, "2", timeout=150, **PROXY_ENV)
        stored = httpx.get(
            f"{server.url}/admin/v1/rollouts/{ours['rollout_id']}/spans",
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=30,
        ).json()["items"]

    # Several spans per call, all under the call's id; the reward after both calls.
    calls = by_sequence(theirs["spans"])
    assert len(calls) == 3 and calls[2] == ["agentlightning.annotation"]
    assert all(names.count("raw_gen_ai_request") == 1 and len(names) > 1 for names in calls[:2])
    # The kinds of span under each call's id; how many of a kind LiteLLM's proxy emits varies between runs (a
    # second ``proxy_pre_call`` was seen once in CI on a loaded machine), which is the proxy's, not the store's.
    assert [sorted(set(names)) for names in by_sequence(ours["spans"])] == [sorted(set(names)) for names in calls]
    assert [s[1] for s in ours["spans"]] == sorted(s[1] for s in ours["spans"])  # in sequence order
    # The adapter gets both calls, the reward on the last one, as from Agent-lightning's own store.
    assert [t["reward"] for t in ours["triplets"]] == [None, 1.0]
    assert ours["triplets"] == theirs["triplets"]
    # Rollway's own records: every span, sequence ids unique and gap-free; each keeps the id it was sent with.
    assert sorted(s["sequence_id"] for s in stored) == list(range(1, len(ours["spans"]) + 1))
    sent = sorted(s.get("agl_sequence_id", s["sequence_id"]) for s in stored)
    assert sent == sorted(s[1] for s in ours["spans"])
