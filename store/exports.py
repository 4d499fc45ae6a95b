"""What an export asks for and hands back: which finished rollouts a page holds (``ExportQuery``, the same
object from the admin route's query parameters to the statement), the rollouts (``ExportRollout``), each with the
spans of its latest attempt (``ExportSpan``), a page at a time (``ExportPage``), as ``Store.export_rollouts``
reads them (``store.sql.exports`` says in which order, and how the cursor moves); and the primary reward a span
carries (``reward_value``).

Token ids are most of an export's bytes, and turning them into Python ints and back costs more than everything
else together. So the attributes in ``RAW_ARRAYS`` (flat arrays of numbers) are handed over as ``RawJson``,
their stored compact JSON text, cut out of the attributes text without being decoded; the rest of the
attributes is decoded as usual. Attributes stored in another layout are simply decoded in full.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, field_validator

from rollway.store.schemas import MetadataValue, checked_metadata_filter

MAX_EXPORT_LIMIT = 10_000


#: ``since=now``: an empty page whose ``next_cursor`` is the export's position now, so a trainer's first pull
#: takes only what finishes after it started (not every earlier run's rollouts).
NOW = "now"


class ExportQuery(BaseModel):
    """Which finished rollouts an export page holds, and from where. The admin exports take it as their query
    parameters (``?rollout_id=...&group_id=...&since=...&limit=...&partial=...``) and hand it to the store as is."""

    model_config = ConfigDict(frozen=True, validate_by_name=True, validate_by_alias=True)

    rollout_ids: list[str] | None = Field(
        None,
        alias="rollout_id",
        description="only these rollouts (repeat the parameter), each exported once finished, whatever its group",
    )
    group_id: str | None = Field(None, description="only this group (whole and once complete, unless `partial`)")
    mode: Literal["train", "val", "test"] | None = Field(
        None, description="only rollouts of this mode (a rollout enqueued without one has none: left out)"
    )
    metadata: list[str] | None = Field(
        None,
        description="only rollouts whose task metadata holds `key=value` (repeat the parameter; the value is read "
        'as JSON when it parses, so `step=3` is the number and `step="3"` the string)',
    )
    model_versions: list[str] | None = Field(
        None,
        alias="model_version",
        description="only rollouts whose every LLM call was answered by one of these model versions (repeat the "
        "parameter: the current version and the one before, say); a group's members are kept each on its own",
    )
    since: str | None = Field(
        None, description="the `next_cursor` of the page before; `now`: an empty page whose cursor starts from now"
    )
    limit: int = Field(100, ge=1, le=MAX_EXPORT_LIMIT, description="rollouts in the page (a group comes whole)")
    partial: bool = Field(False, description="each finished rollout as it finishes, not whole complete groups")
    dedupe: bool = Field(
        True,
        description="drop the calls a later call of the same rollout repeats with the same prompt (the agent's "
        "retries); every row says how many of its rollout's calls that removed (`deduped_calls`), and the page "
        "how many in all; false keeps every call",
    )
    keep_removed: bool = Field(
        False,
        description="keep the rollouts whose agent server asked to drop their sample (Osmosis `remove_sample`), "
        "which merged rows, SLIME samples and verl rows leave out by default (the page says how many: "
        "`removed_samples`), a grouped SLIME export with their whole groups (`removed_groups`); triplets always "
        "keep them; every row says `remove_sample`",
    )

    @field_validator("metadata")
    @classmethod
    def _pairs(cls, pairs: list[str] | None) -> list[str] | None:
        for pair in pairs or ():
            if "=" not in pair or not pair.split("=", 1)[0]:
                raise ValueError(f"metadata filter {pair!r}: write it as key=value")
        if pairs:
            checked_metadata_filter(_metadata_filter(pairs))
        return pairs

    @property
    def metadata_filter(self) -> dict[str, MetadataValue]:
        """``metadata`` as ``{key: value}``."""
        return _metadata_filter(self.metadata or [])

    @property
    def one_by_one(self) -> bool:
        """Rollouts exported each on its own, not as whole complete groups."""
        return self.partial or self.rollout_ids is not None


def _metadata_filter(pairs: list[str]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for pair in pairs:
        key, raw = pair.split("=", 1)
        try:
            found[key] = json.loads(raw)
        except ValueError:
            found[key] = raw  # a bare word: the string itself
    return found


REWARD_SPAN = "rollway.reward"
# The fields of a reward span each try of a request sets itself (its time): a retry that finds the first try's
# span does not compare them.
REWARD_STAMPED = ("start_time", "end_time")
PRIMARY_REWARD = "primary"
AGL_ANNOTATION = "agentlightning.annotation"
AGL_PRIMARY_REWARD = "agentlightning.reward.0.value"


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def reward_value(name: str, attributes: Mapping[str, Any]) -> float | None:
    """The primary reward a span (its name and attributes) carries, or None when it is not a reward span or its
    value is null: what the exports match to calls (``admin.adapters.triplets``, rule 4)."""
    if name == REWARD_SPAN:
        if (attributes.get("rollway.reward.name") or PRIMARY_REWARD) != PRIMARY_REWARD:
            return None
        return _number(attributes.get("rollway.reward.value"))
    if AGL_PRIMARY_REWARD in attributes:
        return _number(attributes[AGL_PRIMARY_REWARD])
    if name == AGL_ANNOTATION:
        return _number(attributes.get("reward"))
    return None


@dataclass(frozen=True, slots=True)
class RawJson:
    """The compact JSON text of a value, passed through an export without being decoded."""

    text: str


#: Span attributes holding flat arrays of numbers, read as ``RawJson``.
RAW_ARRAYS = ("rollway.prompt_token_ids", "rollway.response_token_ids", "rollway.response_logprobs")
_RAW_KEYS = tuple((key, f'"{key}":') for key in RAW_ARRAYS)


def read_attributes(text: str | None) -> dict[str, Any]:
    """Decode a span's attributes, with the top-level ``RAW_ARRAYS`` left as ``RawJson``.

    Each such array is found by its key in the compact text and replaced by a placeholder before the rest is
    decoded. Anything unexpected — spaces, an array that is not flat numbers, a key found inside a nested
    object rather than at the top — falls back to decoding everything.
    """
    if not text:
        return {}
    cuts: list[tuple[int, int, str]] = []
    for key, pattern in _RAW_KEYS:
        at = text.find(pattern)
        if at < 0:
            continue
        start = at + len(pattern)
        if not text.startswith("[", start):
            continue  # null, or not an array
        end = text.find("]", start) + 1
        if end == 0 or _not_flat(text, start, end):
            return dict(orjson.loads(text))
        cuts.append((start, end, key))
    if not cuts:
        return dict(orjson.loads(text))
    cuts.sort()
    pieces: list[str] = []
    position = 0
    for start, end, _ in cuts:
        pieces += (text[position:start], _PLACEHOLDER)
        position = end
    pieces.append(text[position:])
    attributes: dict[str, Any] = orjson.loads("".join(pieces))
    for start, end, key in cuts:
        if attributes.get(key) != _PLACEHOLDER_VALUE:  # the key was inside a nested object
            return dict(orjson.loads(text))
        attributes[key] = RawJson(text[start:end])
    return attributes


_PLACEHOLDER = '"\\u0000raw"'
_PLACEHOLDER_VALUE = "\x00raw"


def _not_flat(text: str, start: int, end: int) -> bool:
    """Whether ``text[start:end]`` (``[...]``) holds anything but numbers and commas, compactly written."""
    return (
        text.find(" ", start, end) >= 0
        or text.find('"', start, end) >= 0
        or text.find("{", start, end) >= 0
        or text.find("[", start + 1, end) >= 0
    )


@dataclass(frozen=True, slots=True)
class ExportStatus:
    """A stored span's status code (``UNSET``, ``OK``, ``ERROR``), as ``store.Span.status`` has it."""

    status_code: str


#: One ``ExportStatus`` per status code, shared by the spans that have it.
STATUSES = {code: ExportStatus(code) for code in ("UNSET", "OK", "ERROR")}


@dataclass(slots=True)
class ExportSpan:
    """The parts of a stored span an export reads (events, links, resource and the status description are not
    loaded); token id and logprob arrays are ``RawJson``."""

    rollout_id: str
    attempt_id: str
    sequence_id: int
    span_id: str
    name: str
    start_time: float | None
    attributes: dict[str, Any]
    status: ExportStatus = STATUSES["UNSET"]


@dataclass(slots=True)
class ExportRollout:
    rollout_id: str
    latest_attempt_id: str | None
    status: str
    group_id: str | None
    group_size: int | None
    group_index: int | None
    finish_seq: int
    export_seq: int
    spans: list[ExportSpan] = field(default_factory=list)
    #: The agent server asked to drop the latest attempt's sample (Osmosis ``remove_sample``: ``true`` in the
    #: ``extra_fields`` of the completion recorded in the attempt's metadata). ``export`` sets it.
    remove_sample: bool = False
    #: The position of the rollout's group: the largest ``finish_seq`` of its finished members (its own without
    #: a group). Equal to ``export_seq`` in grouped mode; the same for every member of a group in one page in
    #: every mode. ``export`` sets it (0 until then).
    group_seq: int = 0


@dataclass(slots=True)
class ExportPage:
    rollouts: list[ExportRollout]
    next_cursor: str | None
