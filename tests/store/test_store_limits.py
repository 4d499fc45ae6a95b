"""Values the columns cannot hold (PostgreSQL's ``varchar(n)`` and 32-bit integers; SQLite stores anything): both
engines answer the same — a ``StoreValidationError`` for a text longer than its column, and a span whose token
counts do not fit the count columns is written whole (they are summaries of its attributes) — and never a
database error (a 500 at the edge). Runs on SQLite and PostgreSQL."""

from __future__ import annotations

import math

import pytest

from rollway.store import Store, StoreValidationError, TaskSpec
from rollway.store.db import limits
from support.store_helpers import span


async def _running(store: Store) -> tuple[str, str]:
    started = await store.start_rollout(TaskSpec(input="x"))
    return started.rollout.rollout_id, started.attempt.attempt_id


@pytest.mark.parametrize(("field", "length"), [("span_id", limits.SPAN_ID_CHARS), ("trace_id", limits.SPAN_ID_CHARS)])
async def test_a_span_id_longer_than_its_column_is_refused_on_both_engines(
    store: Store, field: str, length: int
) -> None:
    rid, aid = await _running(store)
    assert await store.add_spans([span(rid, aid, **{field: "a" * length})])  # as long as the column: stored

    with pytest.raises(StoreValidationError, match=field):
        await store.add_spans([span(rid, aid), span(rid, aid, **{field: "b" * (length + 1)})])

    assert len(await store.query_spans(rid, aid)) == 1  # nothing of the refused batch
    parent = span(rid, aid, parent_id="p" * (limits.SPAN_ID_CHARS + 1))
    with pytest.raises(StoreValidationError, match="parent_id"):
        await store.add_spans([parent])


async def test_a_span_name_longer_than_its_column_is_cut_and_its_batch_kept_on_both_engines(store: Store) -> None:
    """A tracer naming a span after its input (a prompt): the batch -- the agent's trajectory -- is written."""
    rid, aid = await _running(store)
    long_name = "n" * limits.SPAN_NAME_CHARS + "tail"

    written = await store.add_spans([span(rid, aid, name="first"), span(rid, aid, name=long_name)])

    assert [s.sequence_id for s in written] == [1, 2]
    stored = await store.query_spans(rid, aid)
    assert [s.name for s in stored] == ["first", "n" * limits.SPAN_NAME_CHARS]


@pytest.mark.parametrize("count", [5_000_000_000, 2**70, -(2**40), 1e300, math.inf, math.nan])
async def test_a_span_whose_token_counts_do_not_fit_a_column_is_written_with_its_attributes(
    store: Store, count: float
) -> None:
    rid, aid = await _running(store)
    attributes = {"gen_ai.usage.input_tokens": count, "gen_ai.usage.output_tokens": 7}

    [written] = await store.add_spans([span(rid, aid, attributes=attributes)])

    assert written.sequence_id == 1
    [stored] = await store.query_spans(rid, aid)
    kept = stored.attributes["gen_ai.usage.input_tokens"]
    assert kept == count if math.isfinite(count) else kept is None  # JSON has no NaN nor infinity: null
    assert (await store.stats()).output_tokens == 7


@pytest.mark.parametrize("odd", [math.nan, math.inf, -math.inf])
async def test_a_task_input_or_metadata_that_is_not_finite_is_refused_and_nothing_is_written(
    store: Store, odd: float
) -> None:
    """The JSON columns' encoder writes NaN and Infinity as null: such a value would be stored as something else
    than was sent. Every write of a task's input or metadata, or an attempt's metadata, refuses it first, at any
    depth; a finite float beside it is what a task holds as usual."""
    word = "NaN" if math.isnan(odd) else "Infinity" if odd > 0 else "-Infinity"
    deep = {"q": [1.5, {"x": odd}]}
    for task in ({"input": odd}, {"input": deep}, {"input": 1, "metadata": {"score": odd}}):
        with pytest.raises(StoreValidationError, match=f"holds {word}: a JSON number must be finite"):
            await store.enqueue([{"input": "fine"}, task])
        with pytest.raises(StoreValidationError, match="must be finite"):
            await store.start_rollout(task)
    assert (await store.list_rollouts()).items == []
    rid, aid = await _running(store)
    for changes in ({"input": deep}, {"metadata": {"a": odd}}):
        with pytest.raises(StoreValidationError, match="must be finite"):
            await store.update_rollout(rid, changes)
    with pytest.raises(StoreValidationError, match="attempt metadata holds"):
        await store.update_attempt(rid, aid, status="succeeded", metadata={"a": [odd]})
    rollout, attempt = await store.get_rollout(rid), await store.get_attempt(rid, aid)
    assert (rollout.input, rollout.metadata, attempt.metadata, attempt.status) == ("x", None, None, "preparing")


async def test_a_worker_id_longer_than_its_column_is_refused_on_both_engines(store: Store) -> None:
    long_id = "w" * (limits.WORKER_ID_CHARS + 1)
    await store.enqueue([TaskSpec(input="queued")])
    rid, _ = await _running(store)

    for write in (
        lambda: store.start_rollout(TaskSpec(input="y"), long_id),
        lambda: store.claim(long_id),
        lambda: store.start_attempt(rid, long_id),
        lambda: store.update_attempt(rid, worker_id=long_id),
        lambda: store.worker_heartbeat(long_id),
    ):
        with pytest.raises(StoreValidationError, match="worker_id"):
            await write()

    assert len(await store.claim("w" * limits.WORKER_ID_CHARS)) == 1  # as long as the column: fine


@pytest.mark.postgres
async def test_a_value_postgresql_cannot_hold_is_a_validation_error_not_a_database_failure(pg_url: str) -> None:
    store = await Store.open(pg_url, run_watchdog=False)
    try:
        with pytest.raises(StoreValidationError, match="too long"):
            await store.update_resources("r" * 65, {"prompt": "hi"})  # resources_id is varchar(64)
    finally:
        await store.close()
