"""The dashboard's rollouts page with a large store: time to its first page in Chromium.

Run from the repository root::

    python bench/ui_bench.py                    # 10,000 rollouts, 9 page loads
    python bench/ui_bench.py --rollouts 50000 --repeat 5

``rollway serve`` runs in a subprocess on a temporary SQLite file; 10,000 tasks are enqueued through the admin
API (groups of 4, some then claimed, run and finished, so the statuses differ). Each load opens
``/ui/rollouts`` in a fresh browser context (no cache, no session storage) of the system's headless Chromium
(driven by Playwright, as in ``tests/ui/test_ui_browser.py``) and times from the navigation's start to the first
page's rows drawn (50 rollouts); then the same with a status filter (``?status=succeeded``). The median and the
range are printed. The issue's bound is one second.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import httpx
from playwright.sync_api import Browser, sync_playwright

from rollway.process import GatewayProcess
from support.ui_env import CHROMIUM, CHROMIUM_ARGS  # the tests' launch: headless, no connections of Chromium's own

PAGE_ROWS = 50
FINISHED = 1000  # rollouts claimed and finished, so the store holds several statuses


def fill(url: str, rollouts: int) -> None:
    with httpx.Client(base_url=url, timeout=300) as admin:
        tasks = [{"input": {"question": f"task {i}"}, "mode": "train"} for i in range(rollouts // 4)]
        for start in range(0, len(tasks), 2000):
            chunk = [{**t, "group_size": 4} for t in tasks[start : start + 2000]]
            admin.post("/admin/v1/rollouts", json={"tasks": chunk}).raise_for_status()
        done = 0
        while done < min(FINISHED, rollouts):
            claims = admin.post("/admin/v1/claims", json={"worker_id": "bench", "limit": 100}).json()["claims"]
            for claim in claims:
                rollout_id, attempt_id = claim["rollout"]["rollout_id"], claim["attempt"]["attempt_id"]
                admin.post(f"/admin/v1/rollouts/{rollout_id}/rewards", json={"value": done % 2})
                status = "succeeded" if done % 5 else "failed"
                admin.patch(f"/admin/v1/rollouts/{rollout_id}/attempts/{attempt_id}", json={"status": status})
                done += 1
        total = admin.get("/admin/v1/stats/status").json()["rollouts_by_status"]
        print(f"store: {sum(total.values())} rollouts, {total}")


def first_page(browser: Browser, url: str) -> float:
    """Seconds from the navigation's start to the first page of rows drawn, in a fresh context."""
    context = browser.new_context()
    page = context.new_page()
    try:
        started = time.perf_counter()
        page.goto(url, wait_until="commit")
        rows = page.locator("#rollouts-table tbody tr")
        rows.nth(PAGE_ROWS - 1).wait_for(timeout=30_000)
        took = time.perf_counter() - started
        assert rows.count() == PAGE_ROWS
        return took
    finally:
        context.close()


def report(name: str, times: list[float]) -> None:
    low, median, high = (1000 * t for t in (min(times), statistics.median(times), max(times)))
    print(f"{name}: median {median:.0f} ms (min {low:.0f}, max {high:.0f}, n={len(times)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="rollway-ui-bench-") as folder,
        GatewayProcess(f"sqlite:///{Path(folder) / 'bench.db'}") as gw,
    ):
        started = time.perf_counter()
        fill(gw.url, args.rollouts)
        print(f"filled in {time.perf_counter() - started:.1f} s")
        page = f"{gw.url}/ui/rollouts"
        with sync_playwright() as driver:
            browser = driver.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                first_page(browser, page)  # warm-up: the server's first requests
                plain = [first_page(browser, page) for _ in range(args.repeat)]
                filtered = [first_page(browser, f"{page}?status=succeeded") for _ in range(args.repeat)]
            finally:
                browser.close()
    report(f"/ui/rollouts first page ({args.rollouts} rollouts)", plain)
    report("/ui/rollouts?status=succeeded first page", filtered)


if __name__ == "__main__":
    main()
