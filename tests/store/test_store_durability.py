"""Durability (docs/store.md): ``kill -9`` of a writing process loses no acknowledged write and leaves a
sound SQLite file; a write the store refuses leaves nothing half-written."""

from __future__ import annotations

import asyncio
import contextlib
import os
import selectors
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from sqlalchemy import Connection

from rollway.store import AttemptStatus, ConflictError, RolloutStatus, Store
from rollway.store.db import engine as store_engine
from rollway.store.db import pg_writer
from rollway.store.db import writer as store_writer
from rollway.store.db.pg_writer import PgWriter
from rollway.store.db.writer import BatchWriter
from support.store_helpers import enqueue_one, filled, waiting_for_a_lock

REPO = Path(__file__).resolve().parents[2]
ACKS_BEFORE_KILL = 300
READ_TIMEOUT = 60.0  # for the child to start and acknowledge ACKS_BEFORE_KILL writes

WRITER_SCRIPT = textwrap.dedent(
    """
    import asyncio
    import os
    import sys

    from rollway.store import Store

    WRITERS = 8
    PER_WRITER = 5_000  # bounded: the parent kills long before this


    def say(line):
        os.write(1, (line + "\\n").encode())  # one write per line, unbuffered


    async def main(url):
        store = await Store.open(url, run_watchdog=False)
        started = await store.start_rollout({"input": "durability"})
        rid, aid = started.rollout.rollout_id, started.attempt.attempt_id
        say(f"rollout {rid} {aid}")

        async def writer(w):
            for n in range(PER_WRITER):
                span_id = f"w{w}-{n}"
                span = {
                    "rollout_id": rid,
                    "attempt_id": aid,
                    "trace_id": "t-durability",
                    "span_id": span_id,
                    "name": "chat.completions",
                    "attributes": {"writer": w, "n": n, "payload": "x" * 200},
                }
                written = await store.add_span(span)
                assert written is not None
                say(f"ack {span_id} {written.sequence_id}")

        await asyncio.gather(*(writer(w) for w in range(WRITERS)))
        await store.close()
        say("done")


    asyncio.run(main(sys.argv[1]))
    """
)


class LineReader:
    """Complete lines from a child's stdout, read with a deadline (never blocks past it)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        self._fd = proc.stdout.fileno()
        self._buffer = b""
        self.lines: list[str] = []
        self.eof = False

    def acks(self) -> int:
        return sum(1 for line in self.lines if line.startswith("ack "))

    def read(self, deadline: float, until_acks: int | None = None) -> bool:
        """Read until ``until_acks`` acknowledgements were seen (None: until EOF); False on timeout."""
        with selectors.DefaultSelector() as selector:
            selector.register(self._fd, selectors.EVENT_READ)
            while not self.eof and (until_acks is None or self.acks() < until_acks):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                if not selector.select(remaining):
                    continue
                chunk = os.read(self._fd, 65536)
                if not chunk:
                    self.eof = True  # a partial last line is not an acknowledgement
                    break
                *complete, self._buffer = (self._buffer + chunk).split(b"\n")
                self.lines.extend(raw.decode() for raw in complete)
        return until_acks is None or self.acks() >= until_acks


def _write_until_killed(tmp_path: Path, url: str) -> list[str]:
    """Run the writer script, SIGKILL it once it acknowledged ``ACKS_BEFORE_KILL`` spans; its stdout lines."""
    script = tmp_path / "writer.py"
    script.write_text(WRITER_SCRIPT)
    stderr_path = tmp_path / "writer.stderr"
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": pythonpath}
    command = [sys.executable, str(script), url]
    with (
        stderr_path.open("wb") as stderr,
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, cwd=REPO, env=env) as proc,
    ):
        try:
            reader = LineReader(proc)
            reached = reader.read(time.monotonic() + READ_TIMEOUT, ACKS_BEFORE_KILL)
            assert reached, f"{reader.acks()} acks in {READ_TIMEOUT}s; stderr:\n{stderr_path.read_text()}"
            assert "done" not in reader.lines, "the writer finished before it could be killed"
            os.kill(proc.pid, signal.SIGKILL)
            # Lines already in the pipe were acknowledged before the kill too: read them up to EOF.
            assert reader.read(time.monotonic() + 30)
            assert proc.wait(timeout=30) == -signal.SIGKILL
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    return reader.lines


@pytest.mark.slow
async def test_kill_9_loses_no_acknowledged_span(tmp_path: Path) -> None:
    db = tmp_path / "durable.db"
    url = f"sqlite:///{db}"
    lines = await asyncio.to_thread(_write_until_killed, tmp_path, url)

    assert lines[0].startswith("rollout "), lines[:3]
    _, rollout_id, attempt_id = lines[0].split()
    acked = {}
    for line in lines[1:]:
        kind, span_id, sequence_id = line.split()
        assert kind == "ack"
        acked[span_id] = int(sequence_id)
    assert len(acked) >= ACKS_BEFORE_KILL

    async with await Store.open(url, run_watchdog=False) as store:
        stored = {s.span_id: s.sequence_id for s in await store.query_spans(rollout_id, attempt_id)}
        attempt = await store.get_attempt(rollout_id, attempt_id)
    missing = set(acked) - set(stored)
    assert not missing, f"{len(missing)} acknowledged spans lost, e.g. {sorted(missing)[:5]}"
    assert all(stored[span_id] == seq for span_id, seq in acked.items())
    # Whole transactions survive or vanish: the surviving sequence ids are still 1..n without a gap.
    assert sorted(filled(stored.values())) == list(range(1, len(stored) + 1))
    assert attempt.status == AttemptStatus.RUNNING

    with contextlib.closing(sqlite3.connect(db)) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)


# -- refused writes leave nothing behind ----------------------------------------------------------------


def _span(rollout_id: str, attempt_id: str, span_id: str, **extra: Any) -> dict[str, Any]:
    return {
        "rollout_id": rollout_id,
        "attempt_id": attempt_id,
        "trace_id": "t",
        "span_id": span_id,
        "name": "step",
        **extra,
    }


async def test_a_batch_with_a_used_sequence_id_is_refused_whole(store: Store) -> None:
    started = await store.start_rollout({"input": "x"})
    rid, aid = started.rollout.rollout_id, started.attempt.attempt_id
    first = await store.add_span(_span(rid, aid, "s1"))
    assert first is not None and first.sequence_id == 1

    bad = [_span(rid, aid, "s2"), _span(rid, aid, "s3", sequence_id=1), _span(rid, aid, "s4")]
    with pytest.raises(ConflictError):
        await store.add_spans(bad)

    assert [s.span_id for s in await store.query_spans(rid, aid)] == ["s1"]
    # The refused batch did not move the sequence counter either.
    after = await store.add_span(_span(rid, aid, "s5"))
    assert after is not None and after.sequence_id == 2


async def test_a_refused_batch_spanning_two_rollouts_writes_neither(store: Store) -> None:
    good = await store.start_rollout({"input": "good"})
    stale = await store.start_rollout({"input": "stale"})
    await store.start_attempt(stale.rollout.rollout_id)  # the first attempt of ``stale`` is now stale
    g_rid, g_aid = good.rollout.rollout_id, good.attempt.attempt_id

    with pytest.raises(ConflictError):
        await store.add_spans(
            [
                _span(g_rid, g_aid, "g1"),
                _span(stale.rollout.rollout_id, stale.attempt.attempt_id, "late"),
            ]
        )

    assert await store.query_spans(g_rid, g_aid) == []
    assert await store.query_spans(stale.rollout.rollout_id, "all") == []
    # Not even the heartbeat of the good half was recorded.
    attempt = await store.get_attempt(g_rid, g_aid)
    assert attempt.status == AttemptStatus.PREPARING
    assert attempt.last_heartbeat_time is None


async def test_a_refused_write_does_not_undo_its_neighbours_in_a_group_commit(store: Store) -> None:
    started = await store.start_rollout({"input": "x"})
    rid, aid = started.rollout.rollout_id, started.attempt.attempt_id
    assert await store.add_span(_span(rid, aid, "s1")) is not None

    results = await asyncio.gather(
        store.add_span(_span(rid, aid, "before")),
        store.add_spans([_span(rid, aid, "bad-a"), _span(rid, aid, "bad-b", sequence_id=1)]),
        store.add_span(_span(rid, aid, "after")),
        return_exceptions=True,
    )

    assert isinstance(results[1], ConflictError)
    assert not isinstance(results[0], BaseException) and not isinstance(results[2], BaseException)
    stored = await store.query_spans(rid, aid)
    assert {s.span_id for s in stored} == {"s1", "before", "after"}
    assert [s.sequence_id for s in stored] == [1, 2, 3]


async def test_an_operation_failing_unexpectedly_does_not_undo_its_neighbours_in_a_group_commit(store: Store) -> None:
    started = await store.start_rollout({"input": "x"})
    rid, aid = started.rollout.rollout_id, started.attempt.attempt_id

    def wrote_then_broke(conn: Connection) -> None:
        conn.exec_driver_sql("INSERT INTO counters (name, value) VALUES ('half-written', 1)")
        raise ZeroDivisionError("a bug in one operation")

    results = await asyncio.gather(
        store.add_span(_span(rid, aid, "before")),  # (on SQLite: inline; the two others share a commit)
        store.writer.submit(wrote_then_broke),
        store.add_span(_span(rid, aid, "after")),
        return_exceptions=True,
    )

    assert isinstance(results[1], ZeroDivisionError)
    assert not isinstance(results[0], BaseException) and not isinstance(results[2], BaseException), results
    # (which of the two commits first is not the point: on PostgreSQL they run on two connections at once)
    assert sorted(s.span_id for s in await store.query_spans(rid, aid)) == ["after", "before"]
    half = "SELECT count(*) FROM counters WHERE name = 'half-written'"
    assert await store.read(lambda conn: conn.exec_driver_sql(half).scalar_one()) == 0


async def test_a_large_batch_runs_off_the_event_loop_and_keeps_its_neighbours(tmp_path: Path) -> None:
    """On SQLite a batch of ``OFFLOAD_BATCH`` writes or more runs in the writer's thread, so the loop goes on
    relaying while SQLite writes: a refused write and one that fails unexpectedly still undo only themselves,
    and every caller gets its own answer."""
    async with await Store.open(f"sqlite:///{tmp_path / 'batch.db'}", run_watchdog=False) as store:
        started = await store.start_rollout({"input": "x"})
        rid, aid = started.rollout.rollout_id, started.attempt.attempt_id
        assert await store.add_span(_span(rid, aid, "s1")) is not None
        threads: list[str] = []

        def where(conn: Connection) -> str:
            threads.append(threading.current_thread().name)
            return "here"

        def wrote_then_broke(conn: Connection) -> None:
            conn.exec_driver_sql("INSERT INTO counters (name, value) VALUES ('half-written', 1)")
            raise ZeroDivisionError("a bug in one operation")

        fill = store_writer.OFFLOAD_BATCH  # with the three below, a batch past the bound
        before = store.writer.stats.transactions
        results = await asyncio.gather(
            store.writer.submit(where),  # (inline, in this turn: the others queue behind it and share a commit)
            *(store.add_span(_span(rid, aid, f"ok-{n}")) for n in range(fill)),
            store.add_spans([_span(rid, aid, "bad-a"), _span(rid, aid, "bad-b", sequence_id=1)]),
            store.writer.submit(wrote_then_broke),
            store.writer.submit(where),
            return_exceptions=True,
        )
        assert store.writer.stats.transactions - before == 2
        assert results[0] == results[-1] == "here"
        assert threads[0] == threading.current_thread().name and threads[1].startswith("rollway-store-writer")
        assert isinstance(results[fill + 1], ConflictError) and isinstance(results[fill + 2], ZeroDivisionError)
        assert not any(isinstance(r, BaseException) for r in results[1 : fill + 1]), results
        stored = await store.query_spans(rid, aid)
        assert sorted(s.span_id for s in stored) == sorted(["s1", *(f"ok-{n}" for n in range(fill))])
        half = "SELECT count(*) FROM counters WHERE name = 'half-written'"
        assert await store.read(lambda conn: conn.exec_driver_sql(half).scalar_one()) == 0


async def test_the_write_ahead_log_is_emptied_under_steady_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writes that never pause keep SQLite from starting its log over after a passive checkpoint (each copy is
    overtaken by new commits): without more, the file grows by every write. Past ``WAL_RESET_BYTES`` (1 MiB
    here) a checkpoint empties it, while the writes go on and every one of them lands. The size is read after each
    checkpoint while the writes go on, so it may hold what landed since (on a loaded machine, 0.6 MB was seen):
    the bound is a few times the threshold, where a log never emptied held 12 MB after the first 0.1 s here. A
    checkpoint that cannot empty the log leaves it to the next: one reading in ten may be over."""
    monkeypatch.setattr(store_engine, "WAL_RESET_BYTES", 1 << 20)
    path = tmp_path / "steady.db"
    store = await Store.open(f"sqlite:///{path}", run_watchdog=False)
    stop = asyncio.Event()

    async def write() -> int:
        done = 0
        while not stop.is_set():
            await asyncio.gather(*(store.enqueue([{"input": {"pad": "x" * 2000, "n": done + k}}]) for k in range(8)))
            done += 8
        return done

    writer = asyncio.create_task(write())
    sizes = []
    try:
        for _ in range(10):
            await asyncio.sleep(0.1)
            await store.checkpoint()
            sizes.append(await asyncio.to_thread(os.path.getsize, f"{path}-wal"))
    finally:
        stop.set()
        written = await writer
    # One reading may miss (a checkpoint that found the writer mid-commit leaves the log to the next one).
    assert written > 0 and sum(size < 4 << 20 for size in sizes) >= 9, str(sizes)
    assert (await store.stats()).total_rollouts == written  # nothing lost while the log was emptied
    await store.close()


async def test_a_reader_that_stays_makes_the_log_emptying_back_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Emptying the log holds the write lock while it waits for readers: a reader that stays (a long export, a
    shell on the file) makes it give up after ``WAL_RESET_WAIT_MS`` and not try again for a while, instead of
    keeping the writer waiting every second; once the reader is gone, the log is emptied."""
    monkeypatch.setattr(store_engine, "WAL_RESET_BYTES", 1 << 20)
    path = tmp_path / "pinned.db"
    store = await Store.open(f"sqlite:///{path}", run_watchdog=False)
    await store.enqueue([{"input": {"pad": "x" * 4000, "n": n}} for n in range(50)])
    pinned = sqlite3.connect(path, isolation_level=None)
    pinned.execute("BEGIN")
    pinned.execute("SELECT count(*) FROM rollouts").fetchone()  # a read snapshot older than what follows
    for n in range(200):
        await store.enqueue([{"input": {"pad": "y" * 4000, "n": n}}])
    keeper = None
    try:
        await store.checkpoint()
        keeper = store._wal
        assert keeper is not None and keeper.backoff == 1.0
        assert "could not be emptied" in caplog.text
        emptying: list[int] = []  # each try to empty the log, which waits for readers with the write lock held
        original = keeper.truncate

        def counted() -> None:
            emptying.append(1)
            original()

        monkeypatch.setattr(keeper, "truncate", counted)
        await store.checkpoint()  # within the back-off (1 s): no second wait with the write lock held
        assert emptying == [] and keeper.backoff == 1.0
    finally:
        pinned.execute("COMMIT")
        pinned.close()
    keeper.not_before = 0.0  # the back-off over
    await store.checkpoint()
    assert keeper.backoff == 0.0 and await asyncio.to_thread(os.path.getsize, f"{path}-wal") == 0
    await store.close()


async def test_writes_submitted_while_the_writer_is_paused_wait_and_then_land(tmp_path: Path) -> None:
    store = await Store.open(f"sqlite:///{tmp_path / 'paused.db'}", run_watchdog=False)
    assert isinstance(store.writer, BatchWriter)
    async with store.writer.paused():
        writes = [asyncio.create_task(store.enqueue([{"input": {"n": n}}])) for n in range(5)]
        done, _ = await asyncio.wait(writes, timeout=0.05)
        assert not done  # none ran inline, none as a batch
    assert len(await asyncio.gather(*writes)) == 5
    assert (await store.stats()).total_rollouts == 5
    await store.close()


async def _cancelled_while_waiting(store: Store, holder: asyncpg.Connection, rollout_id: str) -> None:
    """Cancel ``rollout_id`` and stop waiting for it once the write waits for ``holder``'s lock on its row."""
    write = asyncio.create_task(store.cancel(rollout_id))
    while not await waiting_for_a_lock(holder):
        assert not write.done(), write
        await asyncio.sleep(0.01)
    write.cancel()
    with pytest.raises(asyncio.CancelledError):
        await write


@pytest.mark.postgres
async def test_a_postgresql_write_its_caller_left_is_done_and_closing_waits_for_it_not_for_ever(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write goes on when its caller stops waiting (as the SQLite writer's does), and ``close`` waits for it —
    but at most ``CLOSE_WAIT_SECONDS``: a database that stopped answering must not hold up the exit for ever."""
    monkeypatch.setattr(pg_writer, "CLOSE_WAIT_SECONDS", 0.3)
    store = await Store.open(pg_url, run_watchdog=False, keepalive_interval=0)
    done, stuck = await enqueue_one(store, input=1), await enqueue_one(store, input=2)
    holder = await asyncpg.connect(pg_url)
    try:
        async with holder.transaction():
            await holder.execute("SELECT 1 FROM rollouts WHERE rollout_id = $1 FOR UPDATE", done)
            await _cancelled_while_waiting(store, holder, done)
        await holder.execute("BEGIN")
        await holder.execute("SELECT 1 FROM rollouts WHERE rollout_id = $1 FOR UPDATE", stuck)
        await _cancelled_while_waiting(store, holder, stuck)
        await asyncio.wait_for(store.close(), 5)  # gives up on the write still waiting
        await holder.execute("ROLLBACK")
    finally:
        await holder.close()
    async with await Store.open(pg_url, run_watchdog=False) as reopened:
        assert (await reopened.get_rollout(done)).status == RolloutStatus.CANCELLED
        assert (await reopened.get_rollout(stuck)).status == RolloutStatus.QUEUING


@pytest.mark.postgres
async def test_a_postgresql_write_its_caller_left_may_fail_without_an_unretrieved_task_report(pg_url: str) -> None:
    """A write whose caller left and whose connection then drops fails with nobody to tell: asyncio must not
    report it as a task exception never retrieved (a traceback in the log for every such write)."""
    import gc

    reports: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: reports.append(context))
    store = await Store.open(pg_url, run_watchdog=False, keepalive_interval=0)
    rollout_id = await enqueue_one(store, input=1)
    holder = await asyncpg.connect(pg_url)
    try:
        async with holder.transaction():
            await holder.execute("SELECT 1 FROM rollouts WHERE rollout_id = $1 FOR UPDATE", rollout_id)
            await _cancelled_while_waiting(store, holder, rollout_id)
            assert isinstance(store.writer, PgWriter)
            left = set(store.writer._running)  # the write left behind, waiting for the row
            # Its connection is cut under it.
            await holder.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
            ended, pending = await asyncio.wait(left, timeout=10)
            assert ended and not pending
            del ended, left  # (asyncio reports an exception never retrieved when its task is collected)
        gc.collect()
        await asyncio.sleep(0)  # the loop runs the reports asyncio scheduled while collecting
        assert not [r for r in reports if "never retrieved" in str(r.get("message"))], reports
        assert (await store.get_rollout(rollout_id)).status == RolloutStatus.QUEUING  # the write did not land
    finally:
        loop.set_exception_handler(None)
        await holder.close()
        await store.close()
