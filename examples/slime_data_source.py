"""A SLIME data source that trains on what Rollway collected: complete GRPO groups of finished rollouts as
SLIME ``Sample`` lists, in the shape of Agent-lightning's ``AGLDataSource`` (its SLIME integration example).

A background thread pulls ``GET /admin/v1/exports/slime`` (JSON Lines) with the export's ``since`` cursor —
each page holds whole, complete groups only, every finished group exactly once — and puts each group on a
queue; SLIME's synchronous ``get_samples()`` takes groups off it. Nothing of SLIME is imported unless it is
installed: without it, samples are this module's ``Sample`` dataclass with the same field names (duck
typing), so the source runs anywhere, e.g. against ``rollway demo --db demo.db`` and ``rollway serve --db
demo.db``::

    source = RollwayDataSource("http://127.0.0.1:8080", token=None)
    groups = source.get_samples(8)   # 8 lists of Samples, each one whole GRPO group
    source.stop()

``index`` is renumbered as SLIME does (a running sample counter); ``group_index`` is the export's (one value
per group, increasing). With ``partial=True`` a "group" is the members of a page that share a ``group_index``
(members that finish after the page come in a later group). ``rollout_log_probs`` is ``None`` when a call had
no logprobs (fine for GRPO).

Only samples SLIME trains as they are reach it: ``completed`` or ``truncated``, with a reward. SLIME's
``generate_and_rm`` asserts a reward on those, and would generate an ``aborted`` sample again on its own
engines; a missing reward is never made a number here. A group with any other member — a rollout without a
reward, a failed or cancelled one — is held back whole (SLIME expects ``n_samples_per_prompt`` samples per
group): ``held`` maps its group id (a rollout's id without a group) to the rollouts that are not trainable. A
late reward brings the rollout, and its whole group, back along the cursor (docs/exports.md): the group is
handed over then, and leaves ``held``. A group handed over is not handed over again (SLIME trained on it):
when it comes back with the same members — a reward recorded after it was handed over, a member that finished
again — it is skipped, counted in ``repeated`` and logged; with other members (one joined a group without a
declared size) it is a new group and handed over. The ``max_handed`` most recent groups are remembered
(100,000 by default).
With ``partial=True`` each record stands alone: the trainable members
of a page's group are handed over, the others held by rollout id until they come again. A hold is logged once
per group, at warning level (a group that comes again still held is not logged again). ``held`` keeps only the
``max_held`` most recently held groups (10,000 by default): a group that never gets its reward does not make
it grow without bound, and one dropped from it is still handed over if it comes back trainable.

A rollout can give several records: one per segment when the agent rewrote its history (a prefix break), and
one per side choice of an ``n > 1`` call. SLIME counts on ``n_samples_per_prompt`` samples per group (it
reshapes a batch's rewards by it for GRPO), so pass ``n_samples_per_prompt`` (as to Agent-lightning's
``AGLDataSource``) and each rollout gives exactly one sample — its last record that is not a side choice, the
end of its trajectory — and a group with another number of rollouts is held back (``held`` lists all its
rollouts; logged) rather than handed over. ``left_out`` counts the records not handed over for that (earlier
segments, side choices); the first is logged once. Without it (``None``, the default) every record is a sample.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import httpx

logger = logging.getLogger(__name__)

TRAINABLE = frozenset({"completed", "truncated"})  # statuses SLIME trains as they are (with a reward)


class Status(Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"


@dataclass
class Sample:
    """The fields of ``slime.utils.types.Sample`` this source fills (used when SLIME is not installed)."""

    group_index: int | None = None
    index: int | None = None
    prompt: Any = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | None = None
    loss_mask: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    status: Any = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)


def _sample_type() -> tuple[type[Any], Any]:
    try:  # the real thing when SLIME is installed
        from slime.utils.types import Sample as SlimeSample  # type: ignore[import-not-found]

        return SlimeSample, SlimeSample.Status
    except ImportError:
        return Sample, Status


class RollwayDataSource:
    """``get_samples(n)`` → ``n`` complete groups (``list[list[Sample]]``), pulled from Rollway in the background."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        since: str | None = None,
        poll_interval: float = 1.0,
        page_size: int = 256,
        partial: bool = False,
        max_held: int = 10_000,
        n_samples_per_prompt: int | None = None,
        max_handed: int = 100_000,
    ) -> None:
        self.url = url.rstrip("/")
        self.cursor = since
        self.poll_interval = poll_interval
        self.page_size = page_size
        self.partial = partial
        self.sample_type, self.status_type = _sample_type()
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._groups: queue.Queue[list[Any]] = queue.Queue()
        self._stop = threading.Event()
        self._next_index = 0
        self.held: dict[str, list[str]] = {}  # group id (or rollout id) → its rollouts that are not trainable
        self.max_held = max_held  # ``held`` keeps the most recently held groups only (module doc)
        self.n_samples_per_prompt = n_samples_per_prompt  # one sample per rollout, so many per group (module doc)
        self.left_out = 0  # records not handed over because a rollout gives one sample
        self._handed: dict[str, frozenset[str]] = {}  # groups (``partial``: rollouts) handed over → members
        self.max_handed = max_handed
        self.repeated = 0  # groups (rollouts) that came again after they were handed over, skipped
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rollway-data-source", daemon=True)
        self._thread.start()

    # -- SLIME's DataSource interface ------------------------------------------------------------------------

    def get_samples(self, num_samples: int, timeout: float | None = None) -> list[list[Any]]:
        """Block until ``num_samples`` complete groups are available (``TimeoutError`` after ``timeout``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        out: list[list[Any]] = []
        while len(out) < num_samples:
            if self.error is not None:
                raise RuntimeError("the Rollway data source stopped") from self.error
            wait = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
            if wait <= 0:
                raise TimeoutError(f"{len(out)} of {num_samples} groups arrived in time")
            try:
                out.append(self._groups.get(timeout=wait))
            except queue.Empty:
                continue
        return out

    def add_samples(self, samples: list[list[Any]]) -> None:
        """SLIME may hand back partial samples; a Rollway source has nowhere to put them."""

    def save(self, rollout_id: int) -> None:
        """Nothing to save: ``self.cursor`` is where a new source continues (``since=``)."""

    def load(self, rollout_id: int | None = None) -> None:
        """Nothing to load (pass ``since=`` to resume)."""

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def __len__(self) -> int:
        return self._groups.qsize()

    # -- the background puller -------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            with httpx.Client(base_url=self.url, headers=self._headers, timeout=60) as client:
                while not self._stop.is_set():
                    if self._pull(client) == 0:
                        self._stop.wait(self.poll_interval)
        except BaseException as exc:  # surfaced by get_samples
            self.error = exc

    def _pull(self, client: httpx.Client) -> int:
        """One page: its records grouped (a page never splits a group), each group queued; groups queued."""
        params: dict[str, Any] = {"limit": self.page_size, "format": "jsonl", "partial": self.partial}
        if self.cursor:
            params["since"] = self.cursor
        response = client.get("/admin/v1/exports/slime", params=params)
        response.raise_for_status()
        records = [json.loads(line) for line in response.text.splitlines() if line.strip()]
        if any("error" in r and "tokens" not in r for r in records):
            raise RuntimeError(f"the export failed mid-stream: {records[-1]}")
        groups: dict[int, list[dict[str, Any]]] = {}  # by group_index, in the order groups first appear
        for record in records:  # with partial=True a group's members need not be next to each other
            groups.setdefault(record["group_index"], []).append(record)
        for group in groups.values():
            if self.n_samples_per_prompt is not None:
                group = self._one_per_rollout(group)
            ready = self._trainable(group)
            if ready:
                self._groups.put([self._sample(r) for r in ready])
        self.cursor = response.headers.get("x-rollway-next-cursor") or self.cursor
        return len(groups)

    def _one_per_rollout(self, group: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each rollout's last record that is not a side choice (its last record when all are), in order."""
        chosen: dict[str, dict[str, Any]] = {}
        for record in group:
            meta = record["metadata"]
            known = chosen.get(meta["rollout_id"])
            if known is None or not meta.get("side_choice") or known["metadata"].get("side_choice"):
                chosen[meta["rollout_id"]] = record
        left_out = len(group) - len(chosen)
        if left_out and not self.left_out:
            logger.warning(
                "one sample per rollout (n_samples_per_prompt): earlier segments and side choices are left out"
            )
        self.left_out += left_out
        return list(chosen.values())

    def _trainable(self, group: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The records of ``group`` to hand to SLIME (all or none; with ``partial``, each on its own); the
        others are noted in ``held`` (see the module doc)."""
        units = [[r] for r in group] if self.partial else [group]
        ready = []
        for unit in units:
            meta = unit[0]["metadata"]
            key = meta["rollout_id"] if self.partial else meta["group_id"] or meta["rollout_id"]
            lacking = [r for r in unit if r["status"] not in TRAINABLE or r["reward"] is None]
            size = self.n_samples_per_prompt
            wrong_size = size is not None and not self.partial and len(unit) != size
            members = frozenset(r["metadata"]["rollout_id"] for r in unit)
            if self._handed.get(key) == members:
                self.repeated += 1
                logger.info("%s came again after it was handed over (a late reward?): not handed over twice", key)
                continue
            if not lacking and not wrong_size:
                self.held.pop(key, None)
                ready += unit
                self._handed.pop(key, None)
                self._handed[key] = members  # now the most recent
                while len(self._handed) > self.max_handed:
                    del self._handed[next(iter(self._handed))]  # the oldest
                continue
            known = self.held.pop(key, None)
            rollouts = sorted({r["metadata"]["rollout_id"] for r in lacking or unit})
            self.held[key] = rollouts  # now the most recent
            if known is None and lacking:
                logger.warning("holding %s back: %s without a reward, failed or cancelled", key, ", ".join(rollouts))
            elif known is None:
                logger.warning("holding %s back: %d rollouts, n_samples_per_prompt is %s", key, len(unit), size)
            while len(self.held) > self.max_held:
                del self.held[next(iter(self.held))]  # the least recently held
        return ready

    def _sample(self, record: dict[str, Any]) -> Any:
        sample = self.sample_type()
        for name in ("group_index", "prompt", "tokens", "response", "response_length", "reward", "loss_mask"):
            setattr(sample, name, record[name])
        sample.rollout_log_probs = record["rollout_log_probs"]
        sample.status = self.status_type(record["status"])
        sample.metadata = record["metadata"]
        sample.index = self._next_index
        self._next_index += 1
        return sample
