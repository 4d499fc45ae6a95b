"""What each of several OS processes does in the cross-process claim test: open the store, wait for the others,
then claim with a few tasks until the queue is empty, and write what it got to a file. A module of its own, so
that a spawned child can import it by name."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

from rollway.store import Store

TASKS_PER_PROCESS = 8
START_TIMEOUT = 60.0  # seconds a child may take to import and open the store before the start line


async def _claim_until_empty(store: Store, worker_id: str, limit: int) -> list[list[str]]:
    got: list[list[str]] = []
    while True:
        claimed = await store.claim(worker_id, limit=limit)
        if not claimed:
            return got
        for item in claimed:
            assert item.attempt.worker_id == worker_id
            got.append([item.rollout.rollout_id, worker_id, item.attempt.attempt_id])


async def _claim_process_main(url: str, index: int, start: threading.Barrier) -> list[list[str]]:
    store = await Store.open(url, run_watchdog=False)
    try:
        # Every process has imported everything and opened its store: now all start claiming together.
        await asyncio.to_thread(start.wait, START_TIMEOUT)
        results = await asyncio.gather(
            *(_claim_until_empty(store, f"proc{index}-task{t}", limit=1 + t % 2) for t in range(TASKS_PER_PROCESS))
        )
    finally:
        await store.close()
    return [c for per_task in results for c in per_task]


def claim_process(url: str, index: int, start: threading.Barrier, out: str) -> None:
    """A child process's entry point (spawned: it imports this module afresh, by name)."""
    claims = asyncio.run(_claim_process_main(url, index, start))
    Path(out).write_text(json.dumps(claims))
