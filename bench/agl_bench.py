"""Agent-lightning 0.3's real ``LightningStoreClient`` against Rollway (SQLite file, persisted) and against
Agent-lightning's own ``LightningStoreServer`` + ``InMemoryLightningStore`` (nothing on disk), in the same run:
span writes/s (``add_span``) and enqueue/dequeue/s (``enqueue_rollout``, ``dequeue_rollout``), each through
``CONCURRENCY`` concurrent callers of one client.

Run from the repository root (the Agent-lightning environment is the one the test suite builds and caches)::

    python bench/agl_bench.py
    python bench/agl_bench.py --spans 1000 --rollouts 500 --concurrency 8 --agl-python PATH

Each server runs in its own process; the client runs in a third. Rollway's database is a fresh temporary file
each repetition; its access log is off, as Agent-lightning's server has it by default. The two servers are
measured alternately, ``--repeat`` times each, and the medians are reported (the machine is shared: single
runs vary a lot).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from rollway.process import GatewayProcess

CLIENT = Path(__file__).resolve().parent / "agl_bench_client.py"
DEFAULT_AGL = Path.home() / ".cache" / "rollway" / "agl-0.3.0-venv" / "bin" / "python"


def env() -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLWAY_", "PYTHON", "VIRTUAL_ENV"))}
    return base | {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "PYTHONUNBUFFERED": "1"}


def measure(agl_python: str, address: str, args: argparse.Namespace) -> dict[str, Any]:
    command = [agl_python, str(CLIENT), "measure", address, str(args.spans), str(args.rollouts), str(args.concurrency)]
    proc = subprocess.run(command, capture_output=True, text=True, env=env(), timeout=900, cwd=str(CLIENT.parent))
    if proc.returncode != 0:
        raise SystemExit(f"the client failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_rollway(agl_python: str, args: argparse.Namespace) -> dict[str, Any]:
    quiet = {"ROLLWAY_ACCESS_LOG": "false"}
    with tempfile.TemporaryDirectory() as tmp, GatewayProcess(f"sqlite:///{tmp}/bench.db", env=quiet) as server:
        return measure(agl_python, server.url, args)


def run_agl(agl_python: str, args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    server = subprocess.Popen(
        [agl_python, str(CLIENT), "serve", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env(),
        cwd=str(CLIENT.parent),
    )
    try:
        assert server.stdout is not None
        for line in server.stdout:
            if line.startswith("READY"):
                break
        else:
            raise SystemExit("Agent-lightning's server did not start")
        return measure(agl_python, f"http://127.0.0.1:{port}", args)
    finally:
        server.terminate()
        server.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spans", type=int, default=2000)
    parser.add_argument("--rollouts", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8, help="concurrent callers (32: see docs/benchmarks.md)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--agl-python", default=str(DEFAULT_AGL), help="python of an agentlightning==0.3.0 env")
    args = parser.parse_args()
    if not Path(args.agl_python).exists():
        raise SystemExit(
            f"no Agent-lightning environment at {args.agl_python}: "
            "run ROLLWAY_REQUIRE_AGL=1 pytest tests/agl/test_agl_store_client.py once"
        )
    runs: dict[str, list[dict[str, Any]]] = {"agent-lightning 0.3.0 (in memory)": [], "rollway (SQLite file)": []}
    for _ in range(args.repeat):
        runs["agent-lightning 0.3.0 (in memory)"].append(run_agl(args.agl_python, args))
        runs["rollway (SQLite file)"].append(run_rollway(args.agl_python, args))
    keys = ["span_writes_per_s", "enqueues_per_s", "dequeues_per_s", "enqueue_dequeue_per_s"]
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in keys} for name, rs in runs.items()}
    print(f"# {platform.python_version()} cores={os.cpu_count()} args={vars(args)} (medians of {args.repeat})")
    print(f"{'server':36}" + "".join(f"{k:>24}" for k in keys))
    for name, result in medians.items():
        print(f"{name:36}" + "".join(f"{result[k]:>24.0f}" for k in keys))
    print(json.dumps(runs))


if __name__ == "__main__":
    main()
