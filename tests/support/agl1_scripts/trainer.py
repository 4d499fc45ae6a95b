"""One training iteration's rollouts, driven by Agent-lightning 1.0.2's own ``AglRolloutManager``, as its verl
trainer (``agentlightning.verl.trainer``) drives it in ``_rollout``: ``delete_model()``, ``register_model(addresses)``,
then ``enqueue_and_wait_until_completed(non_tensor_batch, is_train=...)``, which POSTs the batch with pre-assigned
uuid-hex ids, polls ``GET /api/rollouts/{id}`` until each is terminal, reads its raw and triplet events, builds the
triplets and deletes it. The batch is a dict of numpy object columns, as verl's ``DataProto.non_tensor_batch``
holds, so no verl or torch is needed. With ``--drain``, the async trainer's gateway calls come around it:
``POST /proxy/resume`` before, ``POST /proxy/pause`` and ``GET /proxy/state`` until nothing is in flight after,
then ``POST /proxy/resume`` again (where the trainer would sync weights first) so that the server is left open.

    python trainer.py --url URL --key KEY --model M --endpoint http://127.0.0.1:8001/v1 \\
        --input '{"prompt": "hi", "behaviour": "go"}' --input '{"behaviour": "two_calls"}'

Stdout is one JSON document: ``registered`` (the models as the server answered), ``rollouts`` (each
``CompletedRollout`` as the manager built it: ``rollout_id``, ``rollout_state``, ``error_message``,
``final_reward``, ``triplets`` with prompt/response token ids, log probs and reward, ``events`` (raw) and
``triplet_events``), ``resumed``/``drain``/``resumed_after`` (with ``--drain``) and ``seconds``. The manager's
progress lines go to stderr. The batch's columns are the union of the inputs' keys, so an input lacking a key that
another input has gets it as null.

``--max-retries`` (default 0) is the manager's ``post_with_retry`` count: it retries any failure, 4xx included,
sleeping 2, 4, 8, 16, then 30 s, so a route that is missing would otherwise stall the run for minutes. GETs keep
the manager's own retry transport (10 tries on 429/502/503/504, no backoff)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from typing import Any

import numpy as np  # type: ignore[import-not-found, unused-ignore]  # only in the 3.12 environment
from agentlightning.client import AgentLightningSyncClient
from agentlightning.hooks import load_hooks
from agentlightning.verl.agl_rollout_manager import AglRolloutManager


def _columns(inputs: list[dict[str, Any]]) -> dict[str, Any]:
    """The inputs as verl's ``non_tensor_batch``: one numpy object array per key (missing values are None)."""
    keys = sorted({key for item in inputs for key in item})
    columns = {}
    for key in keys:
        column = np.empty(len(inputs), dtype=object)
        column[:] = [item.get(key) for item in inputs]
        columns[key] = column
    return columns


def _drain(client: AgentLightningSyncClient, reason: str) -> dict[str, Any]:
    """The async trainer's ``_pause_and_drain_gateway``: pause, then poll the state until nothing is in flight."""
    paused = client.post_with_retry("/proxy/pause", json={"reason": reason}, timeout=300.0).json()
    polls = 0
    while True:
        state = client.get("/proxy/state")
        state.raise_for_status()
        polls += 1
        if int(state.json().get("inflight", 0)) <= 0:
            return {"paused": paused, "state": state.json(), "polls": polls}
        time.sleep(0.25)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the AGL API base URL (no /api)")
    parser.add_argument("--key", default="")
    parser.add_argument("--model", required=True, help="the name registered (actor_rollout_ref.model.path)")
    parser.add_argument("--endpoint", action="append", default=[], help="a model server address (repeatable)")
    parser.add_argument("--input", action="append", default=[], help="one rollout input as JSON (repeatable)")
    parser.add_argument("--n", type=int, default=1, help="rollouts per input in train mode (rollout.n)")
    parser.add_argument("--val", action="store_true", help="is_train=False: one rollout per input, mode val")
    parser.add_argument("--agent-class", default="agent:Agent")
    parser.add_argument("--poll", type=float, default=0.3, help="poll_interval_seconds")
    parser.add_argument("--rollout-timeout", type=float, default=120.0, help="config.timeout_seconds")
    parser.add_argument("--max-retries", type=int, default=0)
    parser.add_argument("--hooks", default=None, help="a file with one RolloutHooks subclass")
    parser.add_argument("--keep-models", action="store_true", help="skip the initial DELETE /api/models")
    parser.add_argument("--drain", action="store_true", help="resume before, pause and drain after")
    args = parser.parse_args()
    inputs = [json.loads(item) for item in args.input] or [{"prompt": "Say hello.", "behaviour": "go"}]

    started = time.monotonic()
    out: dict[str, Any] = {}
    with contextlib.redirect_stdout(sys.stderr):
        manager = AglRolloutManager(
            agl_base_url=args.url,
            agl_key=args.key,
            model=args.model,
            step=1,
            train_rollout_n=args.n,
            rollout_timeout_seconds=args.rollout_timeout,
            poll_interval_seconds=args.poll,
            hooks=load_hooks(args.hooks) if args.hooks else None,
            local_agent_class=args.agent_class,
            local_env_map={"AGL_INPUT": "input"},
        )
        manager.client.max_retries = args.max_retries
        gateway = AgentLightningSyncClient(base_url=args.url, key=args.key, timeout=300, max_retries=args.max_retries)
        if args.drain:
            out["resumed"] = gateway.post_with_retry("/proxy/resume").json()
        if not args.keep_models:
            out["deleted_models"] = manager.delete_model()
        out["registered"] = [model.model_dump(mode="json") for model in manager.register_model(args.endpoint)]
        completed = manager.enqueue_and_wait_until_completed(_columns(inputs), is_train=not args.val)
        out["rollouts"] = [rollout.model_dump(mode="json") for rollout in completed]
        if args.drain:
            out["drain"] = _drain(gateway, "rollout_done step=1")
            # The trainer syncs the weights here and resumes at its next step; resuming now leaves the server open
            # for whatever runs next.
            out["resumed_after"] = gateway.post_with_retry("/proxy/resume").json()
    out["seconds"] = round(time.monotonic() - started, 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
