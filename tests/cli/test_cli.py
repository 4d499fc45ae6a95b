"""The admin commands of ``rollway`` (click's CliRunner against ``rollway serve`` in a subprocess) and
``rollway demo`` end to end as a subprocess."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from openai import OpenAI

from rollway.admin.client_sync import RollwayClient
from rollway.cli.main import main
from rollway.cli.settings_doc import rows_from_source
from rollway.cli.tables import FitTable, render
from rollway.mock import MockBackendProcess
from rollway.process import GatewayProcess

TOKEN = "cli-admin-token"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    db = tmp_path_factory.mktemp("cli") / "gateway.db"
    with GatewayProcess(f"sqlite:///{db}", admin_token=TOKEN) as process:
        yield process


@pytest.fixture
def admin(gateway: GatewayProcess) -> Iterator[RollwayClient]:
    with RollwayClient(gateway.url, TOKEN) as client:
        yield client


def rollway(
    gateway: GatewayProcess, *args: str, token: str | None = TOKEN, stdin: str | None = None, columns: int | None = None
) -> Result:
    env: dict[str, str | None] = (
        {"ROLLWAY_URL": gateway.url, "ROLLWAY_ADMIN_TOKEN": token} if token else {"ROLLWAY_URL": gateway.url}
    )
    env["COLUMNS"] = None if columns is None else str(columns)  # Rich's width (else 80 when not a terminal)
    runner = CliRunner(env={"ROLLWAY_ADMIN_TOKEN": None, **env})
    return runner.invoke(main, list(args), input=stdin, catch_exceptions=False)


def as_json(result: Result) -> Any:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_tasks_enqueue_reads_bare_inputs_and_task_objects(
    gateway: GatewayProcess, admin: RollwayClient, tmp_path: Path
) -> None:
    lines = [
        {"question": "What is 1 + 2?"},  # a bare input
        "just a string input",
        {"input": {"question": "What is 3 + 4?"}, "group_size": 3, "metadata": {"source": "file"}},  # a task
    ]
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    out = as_json(rollway(gateway, "tasks", "enqueue", str(path), "--group-size", "2", "--json"))
    assert out["tasks"] == 3 and len(out["rollout_ids"]) == 2 + 2 + 3
    stored = [admin.get_rollout(rollout_id) for rollout_id in out["rollout_ids"]]
    assert [r.input for r in stored[:4:2]] == [lines[0], lines[1]]
    assert stored[4].input == {"question": "What is 3 + 4?"} and stored[4].metadata == {"source": "file"}
    assert len({r.group_id for r in stored}) == 3

    table = rollway(gateway, "tasks", "enqueue", "-", stdin='{"x": 1}\n')  # stdin, with the rich summary
    assert table.exit_code == 0 and "Enqueued 1 tasks" in table.stdout


def test_tasks_enqueue_lines_sharing_a_group_id_are_its_members_and_group_size_its_size(
    gateway: GatewayProcess, admin: RollwayClient, tmp_path: Path
) -> None:
    lines = [
        {"input": "a", "group_id": "cli-members"},
        {"question": "bare"},  # a task of --group-size rollouts, as before
        {"input": "b", "group_id": "cli-members"},  # sent with the group's first line, whatever --batch-size
        {"input": "c", "group_id": "cli-lone"},  # the only line of its group: --group-size rollouts in it
    ]
    path = tmp_path / "groups.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = as_json(rollway(gateway, "tasks", "enqueue", str(path), "--group-size", "3", "--batch-size", "1", "--json"))
    assert out["tasks"] == 4 and len(out["rollout_ids"]) == 2 + 3 + 3
    members = admin.get_group("cli-members")
    assert [(r.input, r.group_index, r.group_size) for r in members.rollouts] == [("a", 0, 3), ("b", 1, 3)]
    assert (members.size, members.complete) == (3, False)  # a third member is still to come
    assert [r.group_index for r in admin.get_group("cli-lone").rollouts] == [0, 1, 2]
    third = admin.start_rollout({"input": "d", "group_id": "cli-members", "group_size": 3}, worker_id="cli-worker")
    assert (third.rollout.group_index, third.rollout.group_size) == (2, 3)

    before = len(admin.list_rollouts(limit=1000).items)
    for refused, message in (
        ([{"input": i, "group_id": "cli-over"} for i in range(4)], "4 lines, more than its group_size 3"),
        ([{"input": 1, "group_id": "cli-mixed"}, {"input": 2, "group_id": "cli-mixed", "group_size": 2}], "same"),
    ):
        path.write_text("".join(json.dumps(line) + "\n" for line in [{"input": "first"}, *refused]))
        result = rollway(gateway, "tasks", "enqueue", str(path), "--group-size", "3", "--batch-size", "1")
        assert result.exit_code == 2 and message in result.stderr, result.output
    assert len(admin.list_rollouts(limit=1000).items) == before  # refused before anything was sent ("first")


def test_tasks_enqueue_names_the_line_that_is_not_json(gateway: GatewayProcess, tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"ok": 1}\nnot json\n')
    result = rollway(gateway, "tasks", "enqueue", str(path))
    assert result.exit_code == 2 and f"{path}:2" in result.stderr


def test_rollouts_list_filters_by_status(gateway: GatewayProcess, admin: RollwayClient) -> None:
    [kept, cancelled] = admin.enqueue([{"input": "a"}, {"input": "b"}])
    admin.cancel(cancelled.rollout_id)
    page = as_json(rollway(gateway, "rollouts", "list", "--status", "cancelled", "--json"))
    ids = [r["rollout_id"] for r in page["items"]]
    assert cancelled.rollout_id in ids and kept.rollout_id not in ids
    assert {r["status"] for r in page["items"]} == {"cancelled"}
    table = rollway(gateway, "rollouts", "list", "--limit", "1")
    assert table.exit_code == 0 and "status" in table.stdout and "more: --cursor" in table.stderr


def test_rollouts_show_gives_one_rollout_its_attempts_and_its_reward(
    gateway: GatewayProcess, admin: RollwayClient
) -> None:
    claim = admin.start_rollout({"input": "shown"}, worker_id="cli-show")  # another test's tasks may be queued
    admin.update_attempt(claim.rollout.rollout_id, claim.attempt.attempt_id, status="succeeded", reward=0.75)
    shown = rollway(gateway, "rollouts", "show", claim.rollout.rollout_id)
    assert shown.exit_code == 0, shown.output
    assert f"rollout  {claim.rollout.rollout_id}" in shown.stdout and "status   succeeded" in shown.stdout
    assert f"attempt  1  {claim.attempt.attempt_id}  succeeded" in shown.stdout
    assert "0.75" in shown.stdout and "rollway.reward" in shown.stdout
    document = as_json(rollway(gateway, "rollouts", "show", claim.rollout.rollout_id, "--json"))
    assert document["rollout"]["rollout_id"] == claim.rollout.rollout_id
    assert [s["attributes"]["rollway.reward.value"] for s in document["spans"]] == [0.75]
    assert rollway(gateway, "rollouts", "show", "no-such-rollout").exit_code != 0


def test_rollouts_list_newest_first_pages_on_in_that_order(gateway: GatewayProcess, admin: RollwayClient) -> None:
    made = [r.rollout_id for r in admin.enqueue([{"input": i} for i in range(3)])]
    first = as_json(rollway(gateway, "rollouts", "list", "--newest-first", "--limit", "2", "--json"))
    assert [r["rollout_id"] for r in first["items"]] == made[::-1][:2]
    table = rollway(gateway, "rollouts", "list", "--newest-first", "--limit", "2")
    assert f"more: --cursor {first['next_cursor']} --newest-first" in table.stderr  # the command to go on
    rest = as_json(
        rollway(
            gateway, "rollouts", "list", "--newest-first", "--cursor", first["next_cursor"], "--limit", "1000", "--json"
        )
    )
    assert rest["items"][0]["rollout_id"] == made[0]  # the oldest of the three, then older ones
    assert not as_json(rollway(gateway, "rollouts", "list", "--model", "no-such-alias", "--json"))["items"]


def test_models_put_list_swap_pause_resume(gateway: GatewayProcess) -> None:
    assert as_json(rollway(gateway, "models", "list", "--json")) == []  # the first model of this gateway
    empty = rollway(gateway, "models", "list")
    assert empty.exit_code == 0 and "rollway models put ALIAS --backend URL" in empty.stderr
    put = as_json(
        rollway(
            gateway,
            *("models", "put", "policy", "--backend", "http://127.0.0.1:9/v1", "--kind", "vllm"),
            *("--model", "Qwen-0.5B", "--api-key", "sk-upstream-secret", "--backend-id", "b1", "--json"),
        )
    )
    assert put[0]["alias"] == "policy" and put[0]["backends"][0]["has_api_key"] is True
    listed = rollway(gateway, "models", "list", "--json")
    assert "sk-upstream-secret" not in listed.output
    [model] = [m for m in as_json(listed) if m["alias"] == "policy"]
    assert model["backends"][0]["model"] == "Qwen-0.5B" and model["backends"][0]["kind"] == "vllm"

    swapped = as_json(rollway(gateway, "models", "swap", "policy", "--version", "v9", "--json"))
    assert swapped[0]["version"] == "v9" and swapped[0]["backends"][0]["backend_id"] == "b1"
    # A swap to new weights keeps the alias's kind (vllm: token ids captured) unless --kind says otherwise.
    new_weights = ("--backend", "http://127.0.0.1:9/v1", "--model", "Qwen-0.5B-step-2")
    [after] = as_json(rollway(gateway, "models", "swap", "policy", *new_weights, "--json"))
    assert (after["version"], after["backends"][0]["kind"], after["backends"][0]["model"]) == (
        "v10",
        "vllm",
        "Qwen-0.5B-step-2",
    )
    [other] = as_json(rollway(gateway, "models", "swap", "policy", *new_weights, "--kind", "openai", "--json"))
    assert other["backends"][0]["kind"] == "openai"
    assert as_json(rollway(gateway, "models", "pause", "policy", "--json"))[0]["state"]["paused"] is True
    drained = as_json(rollway(gateway, "models", "drain", "policy", "--timeout", "5", "--json"))[0]
    assert drained["drained"] is True and drained["state"]["in_flight"] == 0
    assert as_json(rollway(gateway, "models", "resume", "policy", "--json"))[0]["state"]["paused"] is False
    table = rollway(gateway, "models", "list")
    assert table.exit_code == 0 and "policy" in table.stdout and "serving" in table.stdout
    missing = rollway(gateway, "models", "pause", "no-such-alias")
    assert missing.exit_code == 1 and "404" in missing.stderr
    # a backend key from the environment, kept off the command line (ps, the shell's history)
    env = {"ROLLWAY_URL": gateway.url, "ROLLWAY_ADMIN_TOKEN": TOKEN, "ROLLWAY_BACKEND_API_KEY": "sk-from-the-env"}
    judge = ["models", "put", "judge", "--backend", "http://127.0.0.1:9/v1", "--model", "m", "--json"]
    put_from_env = CliRunner(env=env).invoke(main, judge, catch_exceptions=False)
    assert as_json(put_from_env)[0]["backends"][0]["has_api_key"] is True
    assert rollway(gateway, "models", "delete", "judge").exit_code == 0


def test_keys_mint_prints_a_working_key_once(gateway: GatewayProcess) -> None:
    minted = as_json(rollway(gateway, "keys", "mint", "--scope", "admin", "--name", "ci", "--json"))
    assert minted["scope"] == "admin" and minted["key"]
    # the minted admin key works in place of the token, given as the global option or the command's own
    assert rollway(gateway, "--token", minted["key"], "rollouts", "list", token=None).exit_code == 0
    assert rollway(gateway, "rollouts", "list", "--token", minted["key"], token=None).exit_code == 0
    plain = rollway(gateway, "keys", "mint")
    assert plain.exit_code == 0 and plain.stdout.strip() and "shown only once" in plain.stderr
    assert rollway(gateway, "keys", "revoke", minted["key_id"]).exit_code == 0
    refused = rollway(gateway, "rollouts", "list", "--token", minted["key"], token=None)
    assert refused.exit_code == 1 and "401" in refused.stderr
    assert "the admin token given (--token or ROLLWAY_ADMIN_TOKEN) was refused" in refused.stderr


def test_admin_commands_report_a_missing_token_and_an_unreachable_gateway(gateway: GatewayProcess) -> None:
    refused = rollway(gateway, "rollouts", "list", token=None)
    assert refused.exit_code == 1 and "401" in refused.stderr
    assert "--token or ROLLWAY_ADMIN_TOKEN" in refused.stderr and "was refused" not in refused.stderr
    runner = CliRunner(env={"ROLLWAY_URL": None, "ROLLWAY_ADMIN_TOKEN": None})
    unreachable = runner.invoke(main, ["--url", "http://127.0.0.1:9", "models", "list"])
    assert unreachable.exit_code == 1 and "cannot reach http://127.0.0.1:9" in unreachable.stderr


def test_triplets_export_writes_json_lines(
    gateway: GatewayProcess, admin: RollwayClient, mock: MockBackendProcess, tmp_path: Path
) -> None:
    admin.put_model("tiny", [{"base_url": mock.base_url, "kind": "vllm", "model": "mock-model"}])
    claim = admin.start_rollout({"input": "What is 5 + 6?", "mode": "val"}, worker_id="cli-worker")  # no queue
    rollout = claim.rollout
    with OpenAI(base_url=claim.base_url, api_key=claim.api_key, max_retries=0) as llm:
        llm.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "What is 5 + 6?"}])
    admin.add_reward(rollout.rollout_id, 1.0)
    admin.update_attempt(rollout.rollout_id, status="succeeded")

    out = tmp_path / "triplets.jsonl"
    result = rollway(gateway, "triplets", "export", str(out), "--rollout-id", rollout.rollout_id)
    assert result.exit_code == 0, result.output
    [row] = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["rollout_id"] == rollout.rollout_id and row["reward"] == 1.0 and row["response_token_ids"]
    assert "Wrote 1 triplets" in result.stderr

    version = row["model_version"]
    merged = rollway(gateway, "triplets", "export", "-", "--merge", "--stream", "--rollout-id", rollout.rollout_id)
    [row] = [json.loads(line) for line in merged.stdout.splitlines()]
    assert row["n_calls"] == 1 and 1 in row["loss_mask"]

    def exported(*options: str) -> list[str]:
        done = rollway(gateway, "export", "verl", "-", "--rollout-id", rollout.rollout_id, *options)
        assert done.exit_code == 0, done.output
        return [json.loads(line)["rollout_id"] for line in done.stdout.splitlines()]

    assert exported("--mode", "val", "--model-version", str(version)) == [rollout.rollout_id]
    assert exported("--mode", "train") == [] and exported("--model-version", "not-it") == []
    assert exported("--metadata", "missing=1") == []
    refused = rollway(gateway, "triplets", "export", "-", "--metadata", "no-value")
    assert refused.exit_code == 2 and "KEY=VALUE" in refused.stderr


def asked(admin: RollwayClient, mock: MockBackendProcess, question: str, times: int = 1, **task: Any) -> str:
    """A rollout started by a worker whose agent asks ``question`` ``times`` times through alias ``tiny`` (in
    front of the mock): its id. ``task`` adds to the task (a ``group_id`` and ``group_size``, say)."""
    admin.put_model("tiny", [{"base_url": mock.base_url, "kind": "vllm", "model": "mock-model"}])
    claim = admin.start_rollout({"input": question, **task}, worker_id="cli-worker")
    with OpenAI(base_url=claim.base_url, api_key=claim.api_key, max_retries=0) as llm:
        for _ in range(times):
            llm.chat.completions.create(model="tiny", messages=[{"role": "user", "content": question}])
    return claim.rollout.rollout_id


def test_an_export_says_how_many_repeated_calls_it_removed(
    gateway: GatewayProcess, admin: RollwayClient, mock: MockBackendProcess
) -> None:
    rollout_id = asked(admin, mock, "What is 1 + 1?", times=3)  # the same prompt thrice: two calls are retries
    admin.add_reward(rollout_id, 1.0)
    admin.update_attempt(rollout_id, status="succeeded")

    for command in (("triplets", "export"), ("export", "slime")):
        for stream in ((), ("--stream",)):
            result = rollway(gateway, *command, "-", "--rollout-id", rollout_id, *stream)
            assert result.exit_code == 0, result.output
            assert len(result.stdout.splitlines()) == 1
            assert "(2 repeated calls removed; --keep-retries keeps them)" in result.stderr, result.stderr
    kept = rollway(gateway, "triplets", "export", "-", "--rollout-id", rollout_id, "--keep-retries")
    assert len(kept.stdout.splitlines()) == 3 and "Wrote 3 triplets to stdout\n" in kept.stderr


#: An attempt's metadata as an Osmosis 0.3 agent server's "drop this sample" is recorded (the attempt succeeds with
#: no reward): the flag in the completion's extra_fields.
DROPPED = {"completion": {"status": "COMPLETED", "reward": None, "extra_fields": {"remove_sample": True}}}


def test_an_export_leaves_out_a_sample_its_agent_server_dropped_and_says_so(
    gateway: GatewayProcess, admin: RollwayClient, mock: MockBackendProcess
) -> None:
    rollout_id = asked(admin, mock, "What is 2 + 3?")
    admin.update_attempt(rollout_id, status="succeeded", metadata=DROPPED)

    for stream in ((), ("--stream",), ("--stream", "--page-size", "600")):  # 600: streamed, totals at its end
        left_out = rollway(gateway, "export", "verl", "-", "--rollout-id", rollout_id, *stream)
        assert left_out.exit_code == 0, left_out.output
        assert left_out.stdout == "" and "Wrote 0 verl records" in left_out.stderr
        assert "(1 rollouts left out as their agent server asked; --keep-removed keeps them)" in left_out.stderr
    kept = rollway(gateway, "export", "slime", "-", "--rollout-id", rollout_id, "--keep-removed")
    [sample] = [json.loads(line) for line in kept.stdout.splitlines()]
    assert sample["metadata"]["remove_sample"] is True and "left out" not in kept.stderr
    triplets = rollway(gateway, "triplets", "export", "-", "--rollout-id", rollout_id)
    [row] = [json.loads(line) for line in triplets.stdout.splitlines()]
    assert row["remove_sample"] is True  # triplets keep it


def test_a_slime_export_leaves_out_a_group_one_short_and_says_so(
    gateway: GatewayProcess, admin: RollwayClient, mock: MockBackendProcess
) -> None:
    group: dict[str, Any] = {"group_id": "cli-one-short", "group_size": 2}
    dropped, kept = (asked(admin, mock, f"What is 4 + {n}?", **group) for n in (4, 5))
    admin.update_attempt(dropped, status="succeeded", metadata=DROPPED)
    admin.add_reward(kept, 1.0)
    admin.update_attempt(kept, status="succeeded")

    for stream in ((), ("--stream",), ("--stream", "--page-size", "600")):
        left_out = rollway(gateway, "export", "slime", "-", "--group-id", "cli-one-short", *stream)
        assert left_out.exit_code == 0, left_out.output
        assert left_out.stdout == "" and "Wrote 0 slime records" in left_out.stderr
        assert "1 rollouts left out as their agent server asked; --keep-removed keeps them" in left_out.stderr
        assert "1 groups left out whole with them; --keep-short-groups keeps their other members" in left_out.stderr
    short = rollway(gateway, "export", "slime", "-", "--group-id", "cli-one-short", "--keep-short-groups")
    assert short.exit_code == 0, short.output
    [sample] = [json.loads(line) for line in short.stdout.splitlines()]
    assert sample["metadata"]["rollout_id"] == kept and "groups left out" not in short.stderr
    verl = rollway(gateway, "export", "verl", "-", "--group-id", "cli-one-short")
    assert [json.loads(line)["rollout_id"] for line in verl.stdout.splitlines()] == [kept]
    refused = rollway(gateway, "export", "verl", "-", "--keep-short-groups")
    assert refused.exit_code == 2 and "No such option" in refused.output  # verl keeps a group's other members


@pytest.mark.slow
def test_rollway_demo_runs_the_whole_loop_within_a_minute(tmp_path: Path) -> None:
    out = tmp_path / "demo-triplets.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLWAY_")}
    command = [sys.executable, "-c", "from rollway.cli import main; main()", "demo", "--out", str(out)]
    started = time.monotonic()
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90)
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stdout + done.stderr
    assert elapsed < 60, f"the demo took {elapsed:.1f} s"
    assert "mean reward" in done.stdout and "succeeded" in done.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) >= 8 * 4 * 2  # 8 problems x 4 samples x at least two calls each
    assert {row["reward"] for row in rows} <= {0.0, 1.0, None} and any(row["reward"] == 1.0 for row in rows)
    assert all(row["prompt_token_ids"] and row["response_token_ids"] and row["response_logprobs"] for row in rows)
    assert not list(tmp_path.glob("*.db"))  # its database was a temporary one


def test_agents_put_list_delete_never_show_the_api_key(gateway: GatewayProcess) -> None:
    put = rollway(
        gateway, "agents", "put", "math", "http://127.0.0.1:9", "--api-key", "s3cret-agent-key", "--max-concurrent",
        "4", "--param", "model=policy", "--param", "max_tokens=32", "--json",
    )  # fmt: skip
    [agent] = as_json(put)
    assert agent["has_api_key"] is True and agent["max_concurrent"] == 4
    assert agent["completion_params"] == {"model": "policy", "max_tokens": 32}
    listed = rollway(gateway, "agents", "list", "--json")
    assert [a["name"] for a in as_json(listed)] == ["math"]
    assert "s3cret-agent-key" not in put.output + listed.output
    assert rollway(gateway, "agents", "delete", "math").exit_code == 0
    assert as_json(rollway(gateway, "agents", "list", "--json")) == []
    bad = rollway(gateway, "agents", "put", "math", "http://127.0.0.1:9", "--param", "novalue")
    assert bad.exit_code == 2 and "KEY=VALUE" in bad.output


def test_agents_put_registers_the_protocol_a_server_speaks(gateway: GatewayProcess) -> None:
    """``--protocol v1|0.3`` is kept with the registration (its server is then never asked its ``/health``);
    without it the protocol is null, and any other value is refused before anything is sent."""
    put = rollway(gateway, "agents", "put", "osm", "http://127.0.0.1:9", "--protocol", "0.3", "--json")
    assert [a["protocol"] for a in as_json(put)] == ["0.3"]
    again = rollway(gateway, "agents", "put", "osm", "http://127.0.0.1:9", "--json")
    assert [a["protocol"] for a in as_json(again)] == [None]
    bad = rollway(gateway, "agents", "put", "osm", "http://127.0.0.1:9", "--protocol", "0.2")
    assert bad.exit_code == 2 and "--protocol" in bad.output


@pytest.mark.parametrize(
    "args",
    [
        ["triplets", "export", "{missing}/t.jsonl"],
        ["export", "slime", "{missing}/s.jsonl"],
        ["export", "verl", "{missing}/v.jsonl"],
        ["demo", "--out", "{missing}/d.jsonl"],
        ["demo", "--db", "{missing}/d.db"],
    ],
)
def test_a_file_to_write_in_a_missing_directory_is_refused_before_any_work(tmp_path: Path, args: list[str]) -> None:
    """These ended in a traceback once the work was done (the whole demo, an export's pages) and the result was
    written: now the path is checked first."""
    missing = tmp_path / "missing"
    runner = CliRunner(env={"ROLLWAY_URL": "http://127.0.0.1:1"})  # never reached
    result = runner.invoke(main, [arg.format(missing=missing) for arg in args], catch_exceptions=False)
    assert result.exit_code == 2
    assert f"the directory {missing} does not exist" in result.output


# -- start-up: what the command imports ------------------------------------------------------------------------

HEAVY = ("sqlalchemy", "alembic", "fastapi", "starlette", "uvicorn", "aiohttp", "litellm")
# what `rollway --help` does without, besides: it reads the settings from rollway/settings.py's source
NOT_FOR_HELP = (*HEAVY, "pydantic", "pydantic_settings", "yaml", "httpx", "rich", "rollway.store")


def imported(code: str, *argv: str, env: dict[str, str] | None = None) -> list[str]:
    """Which of NOT_FOR_HELP a fresh interpreter has imported after running ``code`` (its stdout's last line)."""
    probe = (
        f"import json, sys\nsys.argv[1:] = {list(argv)!r}\n"
        f"try:\n    {code}\nexcept SystemExit:\n    pass\n"
        f"print(json.dumps(sorted(m for m in {NOT_FOR_HELP!r} if m in sys.modules)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})}
    )
    assert done.returncode == 0, done.stderr
    found: list[str] = json.loads(done.stdout.splitlines()[-1])
    return found


def test_importing_the_package_or_the_command_line_loads_nothing_heavy() -> None:
    """``import rollway`` and ``rollway --help`` need neither the store's engine nor the server, nor even
    pydantic: measured by bench/cli_start.py; this guards the laziness that makes them fast."""
    assert imported("import rollway") == []
    assert imported("import rollway.cli.main") == []
    assert imported("from rollway.cli import main; main()", "--help") == []
    assert imported("from rollway.cli import main; main()", "serve", "--help") == []


def test_an_admin_command_loads_neither_the_store_engine_nor_the_server(gateway: GatewayProcess) -> None:
    env = {"ROLLWAY_URL": gateway.url, "ROLLWAY_ADMIN_TOKEN": TOKEN}
    loaded = imported("from rollway.cli import main; main()", "models", "list", env=env)
    assert "httpx" in loaded and not set(loaded) & set(HEAVY)
    assert not set(imported("import rollway.store.schemas, rollway.admin.client")) & set(HEAVY)


def test_help_lists_every_setting_whole_within_80_columns() -> None:
    from rollway.settings import Settings, settings_rows

    assert rows_from_source() == settings_rows()  # the help's fast reading of the source agrees with the class
    for args in (["--help"], ["serve", "--help"]):
        result = CliRunner(env={"COLUMNS": "80"}).invoke(main, args)
        assert result.exit_code == 0, result.output
        lines = result.output.splitlines()
        assert max(len(line) for line in lines) <= 80
        for name in Settings.model_fields:
            assert any(line.split()[:1] == [f"ROLLWAY_{name.upper()}"] for line in lines if line.strip()), name


# -- at 80 columns: no word split across lines ------------------------------------------------------------------

LONG_ALIAS = "qwen2.5-7b-instruct-grpo-experiment-42"
LONG_URL = "http://vllm-qwen-7b.rl-training.svc.cluster.local:8000/v1"
LONG_MODEL = "Qwen/Qwen2.5-7B-Instruct-step-000120"
LONG_BACKEND_ID = "backend-with-a-rather-long-id-0001"


def whole(output: str, *words: str, width: int = 80) -> None:
    """Each word is whole on one line (never folded onto the next), and no line is wider than ``width``."""
    lines = output.splitlines()
    assert max((len(line) for line in lines), default=0) <= width, output
    for word in words:
        assert any(word in line for line in lines), f"{word!r} is not whole on one line:\n{output}"


def tabled(output: str) -> bool:
    """Whether the output is a table (its headers side by side on one line), not one block of lines per row."""
    return any({"alias", "state", "backend"} <= set(line.split()) for line in output.splitlines())


def shortened_or_whole(output: str, word: str) -> None:
    """An id appears whole, or as a prefix of it ended with an ellipsis (and then its rest nowhere)."""
    if word in output:
        return
    prefixes = [token[:-1] for token in output.split() if token.endswith("…") and word.startswith(token[:-1])]
    assert prefixes and len(prefixes[0]) >= 6, f"{word!r} is neither whole nor shortened with an ellipsis:\n{output}"
    assert word[len(prefixes[0]) :] not in output


def test_models_list_at_80_columns_splits_no_name(gateway: GatewayProcess, mock: MockBackendProcess) -> None:
    """As a table when it fits, else as one block of lines per backend: every name whole on its line."""
    put = ("models", "put", "cli-policy", "--backend", mock.base_url, "--kind", "vllm", "--model", "mock-model")
    assert rollway(gateway, *put, "--backend-id", "mock", "--json").exit_code == 0
    table = rollway(gateway, "models", "list", columns=80)
    assert table.exit_code == 0, table.output
    whole(table.stdout, "cli-policy", mock.base_url, "vllm", "mock-model", "serving", "up")
    assert tabled(table.stdout), table.stdout  # usual names: a table at 80 columns, as at any wider width
    narrow = rollway(gateway, "models", "list", columns=66)
    assert tabled(narrow.stdout), narrow.stdout
    whole(narrow.stdout, "cli-policy", mock.base_url, "vllm", "mock-model", "serving", "up", width=66)

    long = ("models", "put", LONG_ALIAS, "--backend", LONG_URL, "--kind", "sglang", "--model", LONG_MODEL)
    assert rollway(gateway, *long, "--backend-id", LONG_BACKEND_ID, "--version", "step-000120").exit_code == 0
    for columns in (80, 60, 120):
        listed = rollway(gateway, "models", "list", columns=columns)
        assert listed.exit_code == 0, listed.output
        whole(listed.stdout, LONG_ALIAS, LONG_URL, "sglang", LONG_MODEL, "step-000120", "cli-policy", width=columns)
        shortened_or_whole(listed.stdout, LONG_BACKEND_ID)
    for alias in (LONG_ALIAS, "cli-policy"):
        assert rollway(gateway, "models", "delete", alias).exit_code == 0


def test_models_put_without_a_kind_shows_the_detected_one(gateway: GatewayProcess, mock: MockBackendProcess) -> None:
    """The default kind is ``auto``: the server is asked, and the table says what it found (the mock is vLLM)."""
    put = rollway(gateway, "models", "put", "auto-policy", "--backend", mock.base_url, "--model", "mock-model")
    assert put.exit_code == 0, put.output
    assert "vllm (auto)" in put.stdout
    [model] = [m for m in as_json(rollway(gateway, "models", "list", "--json")) if m["alias"] == "auto-policy"]
    [backend] = model["backends"]
    assert (backend["kind"], backend["detected_kind"]) == ("auto", "vllm")
    assert rollway(gateway, "models", "delete", "auto-policy").exit_code == 0


def test_rollouts_and_agents_at_80_columns_split_no_name(gateway: GatewayProcess, admin: RollwayClient) -> None:
    group = "a-group-id-given-by-the-trainer-that-is-rather-long-0042"
    [rollout] = admin.enqueue([{"input": "x", "group_id": group, "mode": "train"}])
    listed = rollway(gateway, "rollouts", "list", "--group-id", group, columns=80)
    assert listed.exit_code == 0, listed.output
    whole(listed.stdout, rollout.rollout_id, "queuing", "train")
    shortened_or_whole(listed.stdout, group)

    url = "http://agent-server.rl-training.svc.cluster.local:9000"
    params = ("--param", "model=policy", "--param", "max_tokens=32", "--param", "temperature=0.7")
    put = rollway(gateway, "agents", "put", "math-agent-server", url, *params, "--max-concurrent", "4", columns=80)
    assert put.exit_code == 0, put.output
    whole(put.stdout, "math-agent-server", url, '"max_tokens":', "auto")
    pinned = rollway(gateway, "agents", "put", "math-agent-server", url, "--protocol", "0.3", columns=80)
    assert pinned.exit_code == 0, pinned.output
    whole(pinned.stdout, "math-agent-server", url, "0.3")
    assert "auto" not in pinned.stdout
    assert rollway(gateway, "agents", "delete", "math-agent-server").exit_code == 0


def test_a_table_shortens_ids_before_it_splits_a_name_and_wraps_text_between_words() -> None:
    from rich.console import Console

    def shown(table: FitTable, width: int) -> str:
        console = Console(width=width, record=True, file=io.StringIO())
        console.print(render(console, table))
        return console.export_text()

    url = "http://a-long-backend-url.example:8000/v1"
    table = FitTable(("id", "id"), ("name", "name"), ("note", "text"))
    table.add_row("ro-0123456789ab", url, "some words that wrap")
    assert shown(table, 80).splitlines()[-1].split() == ["ro-0123456789ab", url, "some", "words", "that", "wrap"]
    narrower = shown(table, 70)  # the text wraps first, then the id is shortened
    whole(narrower, url, "words", "that", width=70)
    shortened_or_whole(narrower, "ro-0123456789ab")
    assert "some" in narrower and "wrap" in narrower
    records = shown(table, 48)  # too narrow for a table: one "header  value" line per cell
    whole(records, url, "ro-0123456789ab", "some words that wrap", width=48)
    assert shown(table, 44).splitlines()[1:3] == ["name", url]  # a value too wide beside its header: under it


def test_models_update_reloads_in_place_and_lists_the_updates(gateway: GatewayProcess) -> None:
    with MockBackendProcess() as engine:
        backend = ("--backend", engine.base_url, "--kind", "vllm", "--model", "mock-model")
        assert rollway(gateway, "models", "put", "learner", *backend, "--version", "step-0").exit_code == 0
        done = rollway(gateway, "models", "update", "learner", "--version", "step-1", "--note", "cli")
        assert done.exit_code == 0, done.output
        assert "learner: step-0 → step-1 committed" in done.stderr
        # then the version check that follows an update, in the background: it may not have run yet
        paths = [r["path"] for r in engine.requests(limit=10)]
        assert paths[:4] == ["/pause", "/collective_rpc", "/update_weight_version", "/resume"]
        assert set(paths[4:]) <= {"/weight_info"}, paths
        engine.add_faults({"kind": "status", "status": 500, "match": {"path": "/update_weight_version"}})
        failed = rollway(gateway, "models", "update", "learner", "--json")
        assert failed.exit_code == 1
        record = json.loads(failed.stdout)
        assert record["state"] == "failed" and "update_weight_version answered 500" in record["error"]
    listed = as_json(rollway(gateway, "models", "updates", "learner", "--json"))
    assert [(u["to_version"], u["state"], u["note"]) for u in listed] == [
        ("step-2", "failed", None),
        ("step-1", "committed", "cli"),
    ]
    [learner] = [m for m in as_json(rollway(gateway, "models", "list", "--json")) if m["alias"] == "learner"]
    assert learner["version"] == "step-1"
    lines = rollway(gateway, "models", "updates", "learner")
    assert lines.exit_code == 0 and "step-0 → step-1 committed" in lines.stdout
    assert rollway(gateway, "models", "delete", "learner").exit_code == 0
