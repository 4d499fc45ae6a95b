"""Exported rollouts → trainer records: SLIME ``Sample``s and verl-style rows. Pure functions, no I/O.

Both are built on the merged rows of ``admin.adapters.merged`` (one row per rollout segment: calls chained
by token prefix, ``loss_mask`` 1 on sampled tokens), so retries, prefix breaks and choices follow the same
rules as ``GET /admin/v1/triplets?merge=true``. A segment's *prompt* is its first call's prompt; everything
after it — sampled tokens and the tool/observation tokens between turns — is its *response*.

Rewards are the trajectory's outcome, not the per-call matching of triplets. Every record of a rollout (every
segment, before and after a prefix break, and every choice's row) carries the *rollout's reward*: the value of
the last primary reward span (by sequence id) of the rollout's latest attempt, whatever call it matched or
whether it matched one at all — Agent-lightning's ``find_final_reward`` (the last span its ``get_reward_value``
reads a number from), the reward its runner reports for a rollout, and the one trajectory-level reward of the
SLIME integration's multi-turn ``Sample``. A reward span is recognised as for triplets
(``store.exports.reward_value``: a ``rollway.reward`` span named ``primary``, Agent-lightning's
``agentlightning.reward.0.value`` attribute, or an annotation's ``reward``); a null value is no reward. So an
outcome reward recorded after step rewards that took every call is the rollout's, and of two rewards after the
last call the later one is. ``None`` when the attempt has no reward span, and then never a number: no score,
and a SLIME status that does not train. Intermediate rewards stay in the triplet export, matched to calls.

SLIME ``Sample`` (one per segment): ``tokens`` (prompt + response ids), ``response_length``, ``loss_mask`` and
``rollout_log_probs`` (over the response only, so both have ``response_length`` items; logprobs ``0.0`` on
unsampled tokens, ``None`` when a call lacks them), ``reward`` (the rollout's), ``status`` (``completed``;
``truncated`` when the segment ends with the rollout's last call and it stopped on ``length``; ``aborted`` for
a failed or cancelled rollout and for a rollout without a reward — SLIME's ``generate_and_rm`` requires a
reward of every ``completed``/``truncated`` sample, and its own unrewarded samples are the aborted ones),
``group_index`` (the position of the rollout's group, ``ExportRollout.group_seq``: the same for every member in
every mode, increasing along a grouped export), ``index`` (the member's index within its group, 0 without a
group), ``prompt`` (the first call's messages, or a text completion's prompt), ``response`` (the last call's
text; no tokenizer here) and ``metadata`` (rollout, attempt, group ids, segment numbers, finish reason,
``side_choice``: true on the row of a choice the conversation did not continue with, and the merged row's
``model_version``, ``sampling``, ``deduped_calls``, ``logprobs_source``, ``logprobs_complete`` and
``remove_sample``). A
finished rollout without a trainable call gives one ``aborted`` sample with empty ``tokens``, so a group always
has all its members.

verl row (one per segment): ``uid`` (the group id, or the rollout id: what GRPO groups by), ``prompt_ids``,
``response_ids``, ``response_mask``, ``rollout_log_probs``, ``token_level_scores`` (zeros with the rollout's
reward on the last response token; ``None`` when the rollout has no reward — never zeros), ``reward`` and
``status`` (as SLIME's), and the merged row's ``model_version``, ``sampling``, ``deduped_calls``,
``logprobs_source``, ``logprobs_complete`` and ``remove_sample``. Rollouts without a trainable call give no row.

``remove_sample`` is true on every record of a rollout whose agent server asked to drop its sample (Osmosis
``remove_sample``, ``store.exports.ExportRollout``); a SLIME sample says it twice, in ``metadata`` and as SLIME's own
``Sample.remove_sample`` (SLIME keeps such a sample in its group's advantage and takes no loss on it). The export
routes leave such rollouts out, and a grouped SLIME export their groups, unless asked to keep them
(``admin.exports``, ``admin.triplets.Selection``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from rollway.admin.adapters import merged
from rollway.admin.adapters.calls import LlmCall, deduped
from rollway.admin.adapters.merged import MergedRow
from rollway.admin.adapters.triplets import finish_reason, request_prompt, response_choice, reward_value
from rollway.store.exports import ExportRollout, RawJson


def _list(value: RawJson | None) -> list[Any] | None:
    return None if value is None else list(orjson.loads(value.text))


def _prompt_length(mask: list[int]) -> int:
    """Leading context tokens: a segment starts with its prompt (mask 0), then its first response (mask 1)."""
    for position, bit in enumerate(mask):
        if bit:
            return position
    return len(mask)


def _prompt(call: LlmCall) -> Any:
    """SLIME's ``prompt``: a chat call's ``messages``, a text completion's ``prompt`` (as the request had them)."""
    messages, prompt = request_prompt(call)
    return messages if messages is not None else prompt


def _text(call: LlmCall) -> str:
    choice = response_choice(call)
    if choice is None:
        return ""
    message = choice.get("message")
    if isinstance(message, Mapping):
        return str(message.get("content") or "")
    return str(choice.get("text") or "")


class Segment:
    """One merged row of a rollout, split at its prompt, with the calls it chains."""

    def __init__(
        self,
        rollout: ExportRollout,
        row: MergedRow,
        calls: list[LlmCall],
        number: int,
        total: int,
        last_call: int,
        reward: float | None,
        side: bool = False,
    ):
        self.rollout = rollout
        self.row = row
        self.reward = reward  # the rollout's, not the row's (module doc)
        self.calls = calls
        self.number = number
        self.total = total
        self.last_call = last_call  # the rollout's last call's sequence id
        self.side = side  # a choice the conversation did not continue with (admin.adapters.merged)
        self.tokens: list[int] = _list(row["token_ids"]) or []
        mask: list[int] = _list(row["loss_mask"]) or []
        logprobs = _list(row["logprobs"])
        self.prompt_length = _prompt_length(mask)
        self.response_mask = mask[self.prompt_length :]
        self.response_logprobs = None if logprobs is None else logprobs[self.prompt_length :]

    @property
    def response_length(self) -> int:
        return len(self.tokens) - self.prompt_length

    @property
    def finish_reason(self) -> str | None:
        return finish_reason(self.calls[-1]) if self.calls else None

    @property
    def choice_index(self) -> int:
        return self.calls[-1].choice_index if self.calls else 0

    def status(self) -> str:
        if self.rollout.status != "succeeded" or self.reward is None:
            return "aborted"
        last = bool(self.calls) and self.calls[-1].sequence_id == self.last_call
        return "truncated" if last and self.finish_reason == "length" else "completed"

    def metadata(self) -> dict[str, Any]:
        return {
            "rollout_id": self.rollout.rollout_id,
            "attempt_id": self.rollout.latest_attempt_id,
            "group_id": self.rollout.group_id,
            "rollout_status": self.rollout.status,
            "segment": self.number,
            "n_segments": self.total,
            "n_calls": self.row["n_calls"],
            "prefix_breaks": self.row["prefix_breaks"],
            "finish_reason": self.finish_reason,
            "choice_index": self.choice_index,
            "side_choice": self.side,
            "model_version": self.row["model_version"],
            "model_versions": self.row["model_versions"],
            "sampling": self.row["sampling"],
            "deduped_calls": self.row["deduped_calls"],
            "logprobs_source": self.row["logprobs_source"],
            "logprobs_complete": self.row["logprobs_complete"],
            "remove_sample": self.row["remove_sample"],
        }


def rollout_reward(rollout: ExportRollout) -> float | None:
    """The value of the last primary reward span (by sequence id) of the rollout's latest attempt, or None (see
    the module docstring): Agent-lightning's ``find_final_reward``, not a call's matched reward."""
    attempt = rollout.latest_attempt_id
    last: tuple[int, float] | None = None
    for span in rollout.spans:
        if span.attempt_id != attempt:
            continue
        value = reward_value(span)
        sequence_id = span.sequence_id or 0
        if value is not None and (last is None or sequence_id >= last[0]):
            last = (sequence_id, value)
    return None if last is None else last[1]


def segments(rollout: ExportRollout, dedupe: bool = True) -> list[Segment]:
    """The rollout's merged rows with the calls each one chains (in order)."""
    attempt = rollout.latest_attempt_id
    if attempt is None:
        return []
    found, breaks = merged.segments(rollout.spans, attempt, dedupe=dedupe)
    removed = deduped(rollout.spans, attempt) if dedupe else 0
    last_call = max((s.calls[-1].sequence_id for s in found), default=0)
    reward = rollout_reward(rollout)
    return [
        Segment(
            rollout,
            merged.row(s, rollout.rollout_id, attempt, rollout.group_id, breaks, removed, rollout.remove_sample),
            s.calls,
            n,
            len(found),
            last_call,
            reward,
            s.side,
        )
        for n, s in enumerate(found)
    ]


def slime_samples(rollout: ExportRollout, dedupe: bool = True) -> list[dict[str, Any]]:
    """SLIME ``Sample`` fields for each segment of ``rollout`` (see the module docstring)."""
    index = rollout.group_index or 0
    found = segments(rollout, dedupe)
    if not found:
        return [
            {
                "group_index": rollout.group_seq,
                "index": index,
                "prompt": None,
                "tokens": [],
                "response": "",
                "response_length": 0,
                "loss_mask": [],
                "reward": None,
                "rollout_log_probs": None,
                "status": "aborted",
                "remove_sample": rollout.remove_sample,
                "metadata": {
                    "rollout_id": rollout.rollout_id,
                    "attempt_id": rollout.latest_attempt_id,
                    "group_id": rollout.group_id,
                    "rollout_status": rollout.status,
                    "segment": 0,
                    "n_segments": 0,
                    "n_calls": 0,
                    "prefix_breaks": 0,
                    "finish_reason": None,
                    "choice_index": 0,
                    "side_choice": False,
                    "model_version": None,
                    "model_versions": [],
                    "sampling": {},
                    "deduped_calls": 0,
                    "logprobs_source": None,
                    "logprobs_complete": False,
                    "remove_sample": rollout.remove_sample,
                },
            }
        ]
    return [
        {
            "group_index": rollout.group_seq,
            "index": index,
            "prompt": _prompt(s.calls[0]) if s.calls else None,
            "tokens": s.tokens,
            "response": _text(s.calls[-1]) if s.calls else "",
            "response_length": s.response_length,
            "loss_mask": s.response_mask,
            "reward": s.reward,
            "rollout_log_probs": s.response_logprobs,
            "status": s.status(),
            "remove_sample": rollout.remove_sample,
            "metadata": s.metadata(),
        }
        for s in found
    ]


def verl_rows(rollout: ExportRollout, dedupe: bool = True) -> list[dict[str, Any]]:
    """verl-style rows for each segment of ``rollout`` (see the module docstring)."""
    rows = []
    for s in segments(rollout, dedupe):
        reward = s.reward
        scores: list[float] | None = None
        if reward is not None:
            scores = [0.0] * s.response_length
            if scores:  # a call may answer no token at all (an immediate stop)
                scores[-1] = reward
        rows.append(
            {
                "uid": rollout.group_id or rollout.rollout_id,
                "rollout_id": rollout.rollout_id,
                "attempt_id": rollout.latest_attempt_id,
                "group_id": rollout.group_id,
                "index": rollout.group_index or 0,
                "segment": s.number,
                "choice_index": s.choice_index,
                "prompt_ids": s.tokens[: s.prompt_length],
                "response_ids": s.tokens[s.prompt_length :],
                "response_mask": s.response_mask,
                "rollout_log_probs": s.response_logprobs,
                "token_level_scores": scores,
                "reward": reward,
                "status": s.status(),
                "model_version": s.row["model_version"],
                "sampling": s.row["sampling"],
                "deduped_calls": s.row["deduped_calls"],
                "logprobs_source": s.row["logprobs_source"],
                "logprobs_complete": s.row["logprobs_complete"],
                "remove_sample": s.row["remove_sample"],
            }
        )
    return rows
