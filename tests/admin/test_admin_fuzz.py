"""Schema-based fuzzing of the admin API: schemathesis generates a few hundred requests from
``/openapi.json`` against a real ``rollway serve``; none may end in a 5xx.

The two long-poll operations (``POST /claims`` with ``wait_seconds``, ``POST /rollouts/wait``) are left out:
their inputs are bounded by the schema (≤ 60 s) and a fuzzer's client times out on a legitimate long wait;
their bad input is covered in test_admin_api.py."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

TOKEN = "fuzz-admin-token"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.mark.slow
def test_schemathesis_finds_no_server_error(tmp_path: Path) -> None:
    cli = shutil.which("schemathesis", path=str(Path(sys.executable).parent)) or shutil.which("schemathesis")
    if cli is None:
        pytest.skip("schemathesis is not installed (pip install -e '.[test]')")
    port = _free_port()
    env = {**os.environ, "ROLLWAY_ADMIN_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1"}
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from rollway.cli import main; main()",
            "serve",
            "--port",
            str(port),
            "--db",
            str(tmp_path / "fuzz.db"),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stderr is not None
        for line in server.stderr:
            if "Uvicorn running on" in line:
                break
        run = subprocess.run(
            [
                cli,
                "run",
                f"http://127.0.0.1:{port}/openapi.json",
                "--checks",
                "not_a_server_error",
                "--max-examples",
                "15",
                "--header",
                f"Authorization: Bearer {TOKEN}",
                "--phases",
                "fuzzing",
                "--seed",
                "1",
                "--generation-deterministic",
                "--include-path-regex",
                "^/admin/v1",
                "--exclude-path-regex",
                "^/admin/v1/(claims|rollouts/wait)$",
                "--request-timeout",
                "10",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "NO_COLOR": "1"},
        )
    finally:
        server.terminate()
        server.communicate(timeout=20)
    assert run.returncode == 0, run.stdout[-4000:]
    generated = re.search(r"(\d+) generated, (\d+) passed", run.stdout)
    assert generated is not None, run.stdout[-2000:]
    assert int(generated.group(2)) >= 200
