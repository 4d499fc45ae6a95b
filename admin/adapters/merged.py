"""One rollout's calls chained into multi-turn rows (``GET /admin/v1/triplets?merge=true``, and the rows SLIME
samples and verl rows are cut from). Pure functions, no I/O; the calls, their choices and rewards come from
``admin.adapters.triplets``.

Merged rows chain the calls of one attempt while each call's prompt token ids start with everything before it
(the previous prompt + response, and so on back to the segment's first prompt): one row per run of such calls.
``loss_mask`` is 1 on sampled response tokens, 0 on prompt, tool and observation tokens. ``logprobs`` is
aligned with ``token_ids``: the sampled logprob on response tokens, ``0.0`` on tokens that were not sampled (so
it converts to a tensor directly; ``loss_mask`` says which positions are real); it is ``None`` for the whole row
when a call of the row has no logprobs or fewer/more than its response tokens. ``logprobs_complete`` says
which, and ``logprobs_source`` how they were had: ``sampled``, ``scored`` when the engine scored some call's
output after the call (``admin.adapters.triplets``, rule 7), None without them. A call whose prompt does not
extend the row (the agent rewrote or truncated history) starts a new row; ``prefix_breaks`` — the number of
such breaks in the attempt — is the same on every row of the rollout. A row's ``reward`` is the last reward
matched to a call of that row (``None`` when no call of it got one); SLIME samples and verl rows, cut from these
rows, carry the rollout's reward instead (``admin.adapters.trainers``).

A call with several choices (``n > 1``) continues its row with the choice the next call's prompt extends by
token prefix (choice 0 when none does, or for the last call); each of its other choices is a row of its own:
the call's prompt and that choice's response (one call, the call's reward), placed after the rows begun before
it. Such rows are not prefix breaks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

from rollway.admin.adapters.calls import LlmCall, LogprobsSource, SpanLike, deduped, items_in, llm_calls
from rollway.admin.adapters.triplets import match_rewards, sampling
from rollway.store.exports import RawJson


class MergedRow(TypedDict):
    """One rollout segment: calls whose prompts extend each other by token prefix, as one sequence."""

    rollout_id: str
    attempt_id: str
    group_id: str | None
    token_ids: RawJson
    loss_mask: RawJson
    logprobs: RawJson | None
    reward: float | None
    n_calls: int
    prefix_breaks: int
    model_version: str | None  # of the segment's last call
    model_versions: list[str]  # of its calls, each once, in call order (more than one: weights changed mid-way)
    sampling: dict[str, Any]  # the last call's sampling parameters
    deduped_calls: int  # calls of the rollout's latest attempt the de-duplication removed (``triplets``, rule 3)
    logprobs_source: LogprobsSource  # ``scored`` when some call's were scored after it, else ``sampled``; None
    logprobs_complete: bool  # ``logprobs`` holds one for every response token (not None)
    remove_sample: bool  # the agent server asked to drop the rollout's sample (``ExportRollout.remove_sample``)


@dataclass(slots=True)
class Segment:
    """A row being built, as the items of its JSON arrays (``"1,2,3"``) in pieces, with the calls it chains."""

    tokens: str  # every token id so far, comma-separated: what the next prompt must start with
    mask: list[str]
    logprobs: list[str] | None
    calls: list[LlmCall] = field(default_factory=list)
    reward: float | None = None
    side: bool = False  # a choice of an n > 1 call that the conversation did not continue with (module doc)
    scored: bool = False  # some call's logprobs were scored after it (``triplets``, rule 7)

    @property
    def logprobs_source(self) -> LogprobsSource:
        """``scored`` when a call's logprobs were scored after it, ``sampled`` when every call's came with its
        answer, None when the row has none (a call lacks some)."""
        if self.logprobs is None:
            return None
        return "scored" if self.scored else "sampled"

    @classmethod
    def start(cls, prompt: str) -> Segment:
        segment = cls(tokens="", mask=[], logprobs=[])
        segment.add_context(prompt[1:-1])
        return segment

    def extension(self, prompt: str) -> str | None:
        """The items ``prompt`` adds after this row's tokens, or None when it does not start with them."""
        end = len(self.tokens) + 1
        if not prompt.startswith(self.tokens, 1) or prompt[end] not in ",]":
            return None
        return prompt[end + 1 : -1]

    def add_context(self, items: str) -> None:
        if not items:
            return
        n = items.count(",") + 1
        self.tokens = f"{self.tokens},{items}" if self.tokens else items
        self.mask.append(",".join("0" * n))
        if self.logprobs is not None:
            self.logprobs.append(",".join(["0.0"] * n))

    def add_response(self, call: LlmCall) -> None:
        items = call.response[1:-1]
        n = items_in(call.response)
        self.tokens = f"{self.tokens},{items}"
        self.mask.append(",".join("1" * n))
        if self.logprobs is not None:
            if call.logprobs is not None and call.logprobs_source is not None:  # one for each response token
                self.logprobs.append(call.logprobs[1:-1])
                self.scored = self.scored or call.logprobs_source == "scored"
            else:
                self.logprobs = None
        self.calls.append(call)
        if call.reward is not None:
            self.reward = call.reward


def _extends(prompt: str, tokens: str) -> bool:
    """Whether the compact JSON array ``prompt`` starts with the items ``tokens``."""
    end = len(tokens) + 1
    return prompt.startswith(tokens, 1) and prompt[end : end + 1] in (",", "]")


def _continuing(choices: list[LlmCall], context: str, following: str | None) -> LlmCall:
    """The choice the next call's prompt (``following``) extends, after ``context`` (the row's items up to the
    call's response); the first choice when none does."""
    if len(choices) > 1 and following is not None:
        for choice in choices:
            if _extends(following, f"{context},{choice.response[1:-1]}"):
                return choice
    return choices[0]


def segments(spans: Sequence[SpanLike], attempt_id: str | None, *, dedupe: bool = True) -> tuple[list[Segment], int]:
    """The rows of attempt ``attempt_id`` in order (rules: module doc), and the number of prefix breaks."""
    if attempt_id is None:
        return [], 0
    by_call: list[list[LlmCall]] = []
    for call in match_rewards(llm_calls(spans, attempt_id, dedupe=dedupe), spans, attempt_id):
        if by_call and by_call[-1][0].sequence_id == call.sequence_id:
            by_call[-1].append(call)
        else:
            by_call.append([call])
    rows: list[Segment] = []
    chain: Segment | None = None
    breaks = 0
    for position, choices in enumerate(by_call):
        prompt = choices[0].prompt
        extension = chain.extension(prompt) if chain is not None else None
        if chain is None or extension is None:
            breaks += chain is not None
            chain = Segment.start(prompt)
            rows.append(chain)
        else:
            chain.add_context(extension)
        following = by_call[position + 1][0].prompt if position + 1 < len(by_call) else None
        chosen = _continuing(choices, chain.tokens, following)
        chain.add_response(chosen)
        for other in choices:
            if other is not chosen:
                alone = Segment.start(other.prompt)  # a batched text completion's choice has its own
                alone.side = True
                alone.add_response(other)
                rows.append(alone)
    return rows, breaks


def _joined(items: list[str]) -> RawJson:
    return RawJson(f"[{','.join(items)}]")


def row(
    segment: Segment,
    rollout_id: str,
    attempt_id: str,
    group_id: str | None,
    breaks: int,
    removed: int = 0,
    remove_sample: bool = False,
) -> MergedRow:
    versions: list[str] = []
    for call in segment.calls:
        version = call.span.attributes.get("rollway.model_version")
        if isinstance(version, str) and version not in versions:
            versions.append(version)
    return MergedRow(
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        group_id=group_id,
        token_ids=RawJson(f"[{segment.tokens}]"),
        loss_mask=_joined(segment.mask),
        logprobs=None if segment.logprobs is None else _joined(segment.logprobs),
        reward=segment.reward,
        n_calls=len(segment.calls),
        prefix_breaks=breaks,
        model_version=versions[-1] if versions else None,
        model_versions=versions,
        sampling=sampling(segment.calls[-1].span.attributes) if segment.calls else {},
        deduped_calls=removed,
        logprobs_source=segment.logprobs_source,
        logprobs_complete=segment.logprobs is not None,
        remove_sample=remove_sample,
    )


def merged_rows(
    rollout_id: str,
    attempt_id: str | None,
    spans: Sequence[SpanLike],
    *,
    group_id: str | None = None,
    dedupe: bool = True,
    remove_sample: bool = False,
) -> list[MergedRow]:
    """The calls of the latest attempt chained by token prefix: one row per segment (rules: module doc); each
    says ``remove_sample`` (the agent server asked to drop the sample)."""
    if attempt_id is None:
        return []
    found, breaks = segments(spans, attempt_id, dedupe=dedupe)
    removed = deduped(spans, attempt_id) if dedupe else 0
    return [row(s, rollout_id, attempt_id, group_id, breaks, removed, remove_sample) for s in found]
