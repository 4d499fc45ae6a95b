"""Trainer exports of a finished ``rollway demo`` run: SLIME ``Sample`` records and verl rows carry the
backend's token ids (checked by asking the mock backend the recorded requests again), loss masks and
rewards as recorded, whole groups in order; ``rollway export slime`` writes them; the data-source example
(``examples/slime_data_source.py``) hands out whole groups. Plus the adapter's rules on hand-made spans."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from itertools import groupby
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from rollway.admin.adapters import merged_rows, triplets
from rollway.admin.adapters.trainers import slime_samples, verl_rows
from rollway.cli.main import main
from rollway.mock import MockBackendProcess
from rollway.process import GatewayProcess
from rollway.store import Span
from rollway.store.exports import ExportRollout
from support.examples import load_example

TOKEN = "export-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def demo_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """A gateway over the database of a finished ``rollway demo`` run (8 problems x 4 samples)."""
    folder = tmp_path_factory.mktemp("demo")
    db = folder / "demo.db"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLWAY_")}
    command = [sys.executable, "-c", "from rollway.cli import main; main()", "demo", "--db", str(db)]
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    with GatewayProcess(f"sqlite:///{db}", admin_token=TOKEN) as process:
        yield process


def get(gateway: GatewayProcess, path: str, **params: Any) -> Any:
    answer = httpx.get(f"{gateway.url}{path}", params=params, headers=AUTH, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def replay(mock: MockBackendProcess, request: dict[str, Any]) -> dict[str, Any]:
    body = {**request, "model": "mock-model", "return_token_ids": True, "logprobs": True, "top_logprobs": 0}
    answer = httpx.post(f"{mock.base_url}/chat/completions", json=body, timeout=30)
    answer.raise_for_status()
    result: dict[str, Any] = answer.json()
    return result


@pytest.mark.slow
def test_slime_export_of_the_demo_carries_the_backends_tokens_masks_and_rewards(
    demo_gateway: GatewayProcess, mock: MockBackendProcess, tmp_path: Path
) -> None:
    records = get(demo_gateway, "/admin/v1/exports/slime", limit=1000)["items"]
    rollouts = get(demo_gateway, "/admin/v1/rollouts", limit=1000)["items"]
    assert len(rollouts) == 32 and {r["status"] for r in rollouts} == {"succeeded"}

    # Groups: complete, contiguous, one group_index each, in increasing order.
    runs = [(gid, list(rs)) for gid, rs in groupby(records, key=lambda r: r["metadata"]["group_id"])]
    assert len(runs) == len({gid for gid, _ in runs}) == 8
    for _, members in runs:
        assert len({m["metadata"]["rollout_id"] for m in members}) == 4
        assert len({m["group_index"] for m in members}) == 1
    assert [rs[0]["group_index"] for _, rs in runs] == sorted({rs[0]["group_index"] for _, rs in runs})

    by_rollout: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        by_rollout.setdefault(record["metadata"]["rollout_id"], []).append(record)
    assert set(by_rollout) == {r["rollout_id"] for r in rollouts}
    for rollout_id, segments in by_rollout.items():
        spans = get(demo_gateway, f"/admin/v1/rollouts/{rollout_id}/spans")["items"]
        calls = [s for s in spans if s["attributes"].get("gen_ai.operation.name") == "chat"]
        [reward] = [s["attributes"]["rollway.reward.value"] for s in spans if s["name"] == "rollway.reward"]
        assert {s["reward"] for s in segments} == {reward}  # the recorded reward, on every segment
        position = 0
        for record in sorted(segments, key=lambda r: r["metadata"]["segment"]):
            n = record["metadata"]["n_calls"]
            own, position = calls[position : position + n], position + n
            truths = [replay(mock, c["attributes"]["rollway.request"]) for c in own]
            responses = [t["choices"][0]["token_ids"] for t in truths]
            logprobs = [[x["logprob"] for x in t["choices"][0]["logprobs"]["content"]] for t in truths]
            tokens, length, mask = record["tokens"], record["response_length"], record["loss_mask"]
            assert len(mask) == length == len(record["rollout_log_probs"]) and 0 < length < len(tokens)
            assert tokens[:-length] == truths[0]["prompt_token_ids"]
            assert tokens == truths[-1]["prompt_token_ids"] + responses[-1]
            assert tokens[-len(responses[-1]) :] == responses[-1]
            tail = tokens[-length:]
            assert [t for t, m in zip(tail, mask, strict=True) if m] == [i for r in responses for i in r]
            sampled = [lp for lp, m in zip(record["rollout_log_probs"], mask, strict=True) if m]
            assert sampled == [x for lp in logprobs for x in lp]
            assert (
                record["status"] == "completed"
                and record["prompt"] == own[0]["attributes"]["rollway.request"]["messages"]
            )
        assert position == len(calls)

    # verl rows: the same sequences split at the prompt, the reward on the last response token.
    rows = get(demo_gateway, "/admin/v1/exports/verl", limit=1000)["items"]
    assert len(rows) == len(records)
    for row, record in zip(rows, records, strict=True):
        assert row["prompt_ids"] + row["response_ids"] == record["tokens"]
        assert row["response_mask"] == record["loss_mask"] and row["uid"] == record["metadata"]["group_id"]
        scores = row["token_level_scores"]
        assert len(scores) == len(row["response_ids"]) and scores[:-1] == [0.0] * (len(scores) - 1)
        assert scores[-1] == row["reward"] == record["reward"] is not None

    # The CLI writes the same records as JSON Lines; a cursor continues after them.
    out = tmp_path / "slime.jsonl"
    runner = CliRunner(env={"ROLLWAY_URL": demo_gateway.url, "ROLLWAY_ADMIN_TOKEN": TOKEN})
    result = runner.invoke(main, ["export", "slime", str(out), "--page-size", "7"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert [json.loads(line) for line in out.read_text().splitlines()] == records
    assert f"Wrote {len(records)} slime records" in result.stderr
    page = httpx.get(f"{demo_gateway.url}/admin/v1/exports/slime", params={"limit": 10}, headers=AUTH).json()
    assert len({r["metadata"]["group_id"] for r in page["items"]}) == 2  # a page never splits a group
    rest = get(demo_gateway, "/admin/v1/exports/slime", since=page["next_cursor"], limit=1000)["items"]
    assert page["items"] + rest == records


@pytest.mark.slow
def test_the_data_source_example_returns_whole_groups(demo_gateway: GatewayProcess) -> None:
    module = load_example("slime_data_source")
    source = module.RollwayDataSource(demo_gateway.url, token=TOKEN, page_size=5, poll_interval=0.2)
    try:
        groups = source.get_samples(8, timeout=60)
        with pytest.raises(TimeoutError):  # every finished group is handed out once
            source.get_samples(1, timeout=1.0)
    finally:
        source.stop()
    assert len(groups) == 8
    seen: set[str] = set()
    indices = []
    for group in groups:
        assert len(group) == 4 and isinstance(group[0], module.Sample)
        assert len({s.metadata["group_id"] for s in group}) == 1 and len({s.group_index for s in group}) == 1
        assert len({s.metadata["rollout_id"] for s in group}) == 4
        assert all(s.status == module.Status.COMPLETED and len(s.loss_mask) == s.response_length for s in group)
        seen.add(group[0].metadata["group_id"])
        indices += [s.index for s in group]
    assert len(seen) == 8 and indices == list(range(32))


# -- the adapter on hand-made spans ---------------------------------------------------------------------------


def _call(seq: int, prompt: list[int], response: list[int], finish: str = "stop") -> Span:
    return Span(
        rollout_id="ro-1",
        attempt_id="at-1",
        sequence_id=seq,
        trace_id=f"{seq:032x}",
        span_id=f"{seq:016x}",
        name="chat policy",
        attributes={
            "gen_ai.operation.name": "chat",
            "gen_ai.response.finish_reasons": [finish],
            "rollway.request": {"messages": [{"role": "user", "content": f"turn {seq}"}]},
            "rollway.response": {"choices": [{"message": {"role": "assistant", "content": f"reply {seq}"}}]},
            "rollway.prompt_token_ids": prompt,
            "rollway.response_token_ids": response,
            "rollway.response_logprobs": [-0.5] * len(response),
        },
    )


def _reward(seq: int, value: float | None) -> Span:
    return Span(
        rollout_id="ro-1",
        attempt_id="at-1",
        sequence_id=seq,
        trace_id=f"{seq:032x}",
        span_id=f"{seq:016x}",
        name="rollway.reward",
        attributes={"rollway.reward.name": "primary", "rollway.reward.value": value},
    )


def _rollout(spans: list[Span], status: str = "succeeded") -> ExportRollout:
    rollout = ExportRollout("ro-1", "at-1", status, "g-1", 2, 1, finish_seq=5, export_seq=9, spans=list(spans))  # type: ignore[arg-type]
    rollout.group_seq = 9
    return rollout


def test_a_multi_turn_rollout_is_one_sample_with_context_tokens_masked() -> None:
    spans = [_call(1, [1, 2], [3, 4]), _call(2, [1, 2, 3, 4, 5], [6], finish="length"), _reward(3, 0.5)]
    [sample] = slime_samples(_rollout(spans))
    assert sample["tokens"] == [1, 2, 3, 4, 5, 6] and sample["response_length"] == 4
    assert sample["loss_mask"] == [1, 1, 0, 1]
    assert sample["rollout_log_probs"] == [-0.5, -0.5, 0.0, -0.5]
    assert (sample["reward"], sample["status"], sample["group_index"], sample["index"]) == (0.5, "truncated", 9, 1)
    assert sample["prompt"] == [{"role": "user", "content": "turn 1"}] and sample["response"] == "reply 2"
    [row] = verl_rows(_rollout(spans))
    assert (row["prompt_ids"], row["response_ids"], row["response_mask"]) == ([1, 2], [3, 4, 5, 6], [1, 1, 0, 1])
    assert row["token_level_scores"] == [0.0, 0.0, 0.0, 0.5] and row["uid"] == "g-1"


def test_a_prefix_break_gives_two_samples_and_a_rollout_without_calls_an_aborted_one() -> None:
    spans = [_call(1, [1, 2], [3]), _call(2, [9, 9], [7]), _reward(3, 1.0)]
    first, second = slime_samples(_rollout(spans))
    assert (first["tokens"], second["tokens"]) == ([1, 2, 3], [9, 9, 7])
    assert [s["metadata"]["segment"] for s in (first, second)] == [0, 1]
    [empty] = slime_samples(_rollout([], status="failed"))
    assert (empty["tokens"], empty["response_length"], empty["status"]) == ([], 0, "aborted")
    assert verl_rows(_rollout([], status="failed")) == []
    [failed] = slime_samples(_rollout(spans[:1], status="failed"))
    assert failed["status"] == "aborted"


def test_every_segment_of_a_rollout_split_at_a_prefix_break_carries_the_rollouts_reward() -> None:
    """The trajectory's outcome reward goes to each of its segments (SLIME and verl), while triplets and merged
    rows keep Agent-lightning's matching: the reward on the last call only."""
    spans = [_call(1, [1, 2], [3]), _call(2, [9, 9], [7]), _reward(3, 1.0)]
    samples = slime_samples(_rollout(spans))
    assert [(s["reward"], s["status"]) for s in samples] == [(1.0, "completed"), (1.0, "completed")]
    rows = verl_rows(_rollout(spans))
    assert [(r["reward"], r["token_level_scores"]) for r in rows] == [(1.0, [1.0]), (1.0, [1.0])]
    assert [t["reward"] for t in triplets("ro-1", "at-1", spans)] == [None, 1.0]
    assert [r["reward"] for r in merged_rows("ro-1", "at-1", spans)] == [None, 1.0]


def test_the_rollouts_reward_is_its_last_reward_span() -> None:
    """An intermediate reward on the first segment and the final one on the second: every record has the final
    one; a reward only on an early call (nothing after the last) is still the rollout's."""
    spans = [_call(1, [1, 2], [3]), _reward(2, 0.25), _call(3, [9, 9], [7]), _reward(4, 0.75)]
    assert [s["reward"] for s in slime_samples(_rollout(spans))] == [0.75, 0.75]
    early = [_call(1, [1, 2], [3]), _reward(2, 0.25), _call(3, [9, 9], [7])]
    assert [s["reward"] for s in slime_samples(_rollout(early))] == [0.25, 0.25]
    assert [r["token_level_scores"] for r in verl_rows(_rollout(early))] == [[0.25], [0.25]]


def test_an_outcome_reward_after_step_rewards_is_the_rollouts_though_no_call_is_left_to_match_it() -> None:
    """A step reward 0.0 after each call, then the outcome 1.0: SLIME and verl get 1.0 (Agent-lightning's
    ``find_final_reward``: the last reward span), not the 0.0 of the last call; triplets keep the matching
    (each step reward on its call, the outcome on none)."""
    spans = [_call(1, [1], [2]), _reward(2, 0.0), _call(3, [1, 2, 7], [4]), _reward(4, 0.0), _reward(5, 1.0)]
    assert [(s["reward"], s["status"]) for s in slime_samples(_rollout(spans))] == [(1.0, "completed")]
    assert [(r["reward"], r["token_level_scores"]) for r in verl_rows(_rollout(spans))] == [(1.0, [0.0, 0.0, 1.0])]
    assert [t["reward"] for t in triplets("ro-1", "at-1", spans)] == [0.0, 0.0]


def test_of_two_rewards_after_the_last_call_the_later_one_is_the_rollouts() -> None:
    """Rewards 0.1 then 0.2 after three calls: the rollout's reward is 0.2 (the last reward span), though
    Agent-lightning's matching gives 0.1 to the last call and 0.2 to the one before it."""
    spans = [_call(1, [1], [2]), _call(2, [1, 2, 7], [4]), _call(3, [1, 2, 7, 4, 8], [6]), _reward(4, 0.1)]
    spans.append(_reward(5, 0.2))
    assert [s["reward"] for s in slime_samples(_rollout(spans))] == [0.2]
    assert [r["reward"] for r in verl_rows(_rollout(spans))] == [0.2]
    assert [t["reward"] for t in triplets("ro-1", "at-1", spans)] == [None, 0.2, 0.1]
    # by sequence id, not by the order spans come in; a null reward is no reward; another attempt's is not its
    other_attempt = Span(
        rollout_id="ro-1",
        attempt_id="at-0",
        sequence_id=7,
        trace_id=f"{7:032x}",
        span_id=f"{7:016x}",
        name="rollway.reward",
        attributes={"rollway.reward.name": "primary", "rollway.reward.value": 0.9},
    )
    shuffled = [spans[4], spans[0], _reward(6, None), other_attempt, spans[3], spans[1], spans[2]]
    assert [s["reward"] for s in slime_samples(_rollout(shuffled))] == [0.2]


def test_a_reward_before_any_call_is_the_rollouts() -> None:
    """A reward span no call precedes matches no call (triplets), but it is the attempt's last reward."""
    spans = [_reward(1, 0.5), _call(2, [1], [2])]
    assert [(s["reward"], s["status"]) for s in slime_samples(_rollout(spans))] == [(0.5, "completed")]
    assert [t["reward"] for t in triplets("ro-1", "at-1", spans)] == [None]


def test_the_data_source_warns_once_per_held_group_and_keeps_the_latest_held_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    module = load_example("slime_data_source")
    source = module.RollwayDataSource("http://127.0.0.1:9", poll_interval=60, max_held=2)
    source.stop()  # nothing listens there: its puller stops at once; ``_trainable`` is what is tested

    def record(rollout: str, group: str, reward: float | None) -> dict[str, Any]:
        status = "completed" if reward is not None else "aborted"
        return {"status": status, "reward": reward, "metadata": {"rollout_id": rollout, "group_id": group}}

    with caplog.at_level("INFO", logger="slime_data_source"):
        for _ in range(3):
            assert source._trainable([record("r1", "g1", 1.0), record("r2", "g1", None)]) == []
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "g1" in warnings[0].getMessage() and "r2" in warnings[0].getMessage()
    assert source._trainable([record("r3", "g2", None)]) == []
    assert source._trainable([record("r4", "g3", None)]) == []
    assert source.held == {"g2": ["r3"], "g3": ["r4"]}  # g1, the least recently held, dropped
    assert source._trainable([record("r1", "g1", 1.0), record("r2", "g1", 0.5)]) != []  # still handed over
    assert source._trainable([record("r5", "g4", None)]) == []
    assert list(source.held) == ["g3", "g4"]


def test_a_rollout_without_a_reward_is_never_scored_zero() -> None:
    """No reward: SLIME records are ``aborted`` with ``reward: None`` (SLIME asserts a reward on completed and
    truncated samples), verl rows have ``reward`` and ``token_level_scores`` None (never zeros); a null reward
    span is no reward."""
    for spans in (
        [_call(1, [1, 2], [3, 4]), _call(2, [1, 2, 3, 4, 5], [6], finish="length")],
        [_call(1, [1, 2], [3]), _call(2, [9, 9], [7]), _reward(3, None)],
    ):
        samples = slime_samples(_rollout(spans))
        assert [(s["reward"], s["status"]) for s in samples] == [(None, "aborted")] * len(samples)
        assert all(s["tokens"] and s["loss_mask"] for s in samples)  # the tokens are still there
        rows = verl_rows(_rollout(spans))
        assert [(r["reward"], r["token_level_scores"], r["status"]) for r in rows] == [(None, None, "aborted")] * len(
            rows
        )


def test_slime_samples_and_verl_rows_say_how_their_logprobs_were_had() -> None:
    scored = _call(2, [1, 2, 3, 4, 5], [6])
    scored.attributes["rollway.logprobs_source"] = "scored"
    missing = _call(3, [9, 9], [7])
    missing.attributes["rollway.response_logprobs"] = None
    spans = [_call(1, [1, 2], [3, 4]), scored, missing, _reward(4, 1.0)]
    first, second = slime_samples(_rollout(spans))
    assert (first["metadata"]["logprobs_source"], first["metadata"]["logprobs_complete"]) == ("scored", True)
    assert (second["metadata"]["logprobs_source"], second["metadata"]["logprobs_complete"]) == (None, False)
    assert second["rollout_log_probs"] is None
    assert [(r["logprobs_source"], r["logprobs_complete"]) for r in verl_rows(_rollout(spans))] == [
        ("scored", True),
        (None, False),
    ]
    [sampled] = verl_rows(_rollout(spans[:1]))
    assert (sampled["logprobs_source"], sampled["logprobs_complete"]) == ("sampled", True)
    [empty] = slime_samples(_rollout([], status="failed"))
    assert (empty["metadata"]["logprobs_source"], empty["metadata"]["logprobs_complete"]) == (None, False)
