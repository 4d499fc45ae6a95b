"""Agent-lightning 0.3's real ``LightningStoreClient`` against Rollway, compared call by call with the same
scenario against Agent-lightning's own ``LightningStoreServer`` + ``InMemoryLightningStore``.

The client runs in its own virtual environment (``tests/support/agl_env.py``); the test skips, saying why, only when
``agentlightning==0.3.0`` cannot be installed.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rollway.process import GatewayProcess
from support.agl_compare import differences
from support.agl_env import agl_python, require_agl, run_script

require_agl()  # the whole module skips, with one line, without the Agent-lightning environment

pytestmark = [pytest.mark.real_component, pytest.mark.slow]
TOKEN = "agl-admin-token-0123456789"


@pytest.fixture(scope="module")
def agl_py() -> str:
    return agl_python()


def test_store_client_gets_the_same_results_from_rollway_as_from_agent_lightning(agl_py: str, tmp_path: Path) -> None:
    with GatewayProcess(f"sqlite:///{tmp_path / 'rollway.db'}", admin_token=TOKEN) as server:
        # The client sends no headers: the admin token travels as a path prefix of its address.
        address = f"{server.url}/t/{TOKEN}"
        with ThreadPoolExecutor(2) as pool:
            theirs_future = pool.submit(run_script, agl_py, "store_scenario.py", "agl")
            ours = run_script(agl_py, "store_scenario.py", address)
            theirs = theirs_future.result()
        logs = "\n".join(server.output)
    assert TOKEN not in logs  # the token in the path is never logged

    # The scenario did what it meant to: a retried rollout, spans with sequence ids, missing objects as None.
    assert ours["retried_is_second_attempt"] is True
    assert [s["sequence_id"] for s in ours["spans_all"]["items"]] == [1, 2]
    assert ours["add_span_dup"] is None and ours["rollout_missing"] is None and ours["resources_missing"] is None
    assert ours["statistics"]["total_spans"] == 2
    assert [r["status"] for r in ours["wait"]] == ["succeeded", "failed", "cancelled"]

    assert differences(ours, theirs) == {}
