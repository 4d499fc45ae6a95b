"""How long the ``rollway`` command takes to start: wall time of ``rollway --help`` and ``rollway models list``
beside ``python -c pass`` (the interpreter's own start), measured in the same run.

Run from the repository root::

    python bench/cli_start.py              # 15 runs of each
    python bench/cli_start.py --runs 31

``models list`` talks to a real gateway: ``rollway serve`` started here on a free loopback port with a temporary
SQLite file (and stopped at the end), holding one model alias so that the table has a row. The three commands
are run in turn, round after round, so that a busy machine slows them alike; each one's median and
interquartile range are printed, with its ratio to ``python -c pass``. The target: both commands within
0.5 s (median) on a 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rollway.admin.client_sync import RollwayClient
from rollway.process import GatewayProcess

TARGET_SECONDS = 0.5


def rollway_command() -> list[str]:
    """The installed ``rollway`` script (what a user runs), else the same entry point through this Python."""
    script = Path(sys.executable).parent / "rollway"
    found = str(script) if script.is_file() else shutil.which("rollway")
    return [found] if found else [sys.executable, "-c", "from rollway.cli import main; main()"]


def timed(command: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited with {done.returncode}:\n{done.stderr}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=15, help="runs of each command (default: 15)")
    args = parser.parse_args()
    rollway = rollway_command()
    token = secrets.token_urlsafe(16)

    with (
        tempfile.TemporaryDirectory(prefix="rollway-cli-bench-") as tmp,
        GatewayProcess(f"sqlite:///{Path(tmp) / 'bench.db'}", admin_token=token) as gateway,
    ):
        with RollwayClient(gateway.url, token) as client:
            client.put_model("policy", [{"base_url": "http://127.0.0.1:9/v1", "kind": "vllm", "model": "m"}])
        env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLWAY_")}
        env |= {"ROLLWAY_URL": gateway.url, "ROLLWAY_ADMIN_TOKEN": token}
        commands = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "rollway --help": [*rollway, "--help"],
            "rollway models list": [*rollway, "models", "list"],
        }
        for command in commands.values():
            timed(command, env)  # once unmeasured: the page cache, .pyc files
        times: dict[str, list[float]] = {label: [] for label in commands}
        for _ in range(args.runs):
            for label, command in commands.items():
                times[label].append(timed(command, env))

    baseline = statistics.median(times["python -c pass"])
    print(f"{'command':<22} {'median':>8} {'IQR':>17} {'x python':>9}")
    for label, runs in times.items():
        median = statistics.median(runs)
        q1, _, q3 = statistics.quantiles(runs, n=4)
        verdict = "" if label.startswith("python") else (" met" if median <= TARGET_SECONDS else " NOT MET")
        print(
            f"{label:<22} {median:7.3f}s {q1:7.3f}s - {q3:6.3f}s {median / baseline:8.1f}x"
            + (f"  (target {TARGET_SECONDS} s:{verdict})" if verdict else "")
        )
    print(
        f"\n{args.runs} runs each; {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs,"
        f" load average {os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()
