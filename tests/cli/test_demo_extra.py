"""``rollway demo`` without the ``demo`` extra: the openai SDK is not a dependency of Rollway, and without it the
demo stops at once with one line saying how to install it, not a traceback (nor a failed attempt per rollout).

The SDK is installed in the test environment, so a fresh interpreter makes it unimportable with a meta-path
blocker before it runs the command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BLOCKED_DEMO = """
import sys

class NoOpenAI:
    def find_spec(self, name, path=None, target=None):
        if name == "openai" or name.startswith("openai."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoOpenAI())
from rollway.cli import main

main(["demo", "--out", sys.argv[1]], prog_name="rollway")
"""


def test_demo_without_openai_says_to_install_the_demo_extra(tmp_path: Path) -> None:
    out = tmp_path / "triplets.jsonl"
    result = subprocess.run(
        [sys.executable, "-c", BLOCKED_DEMO, str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert "rollway[demo]" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr  # one line: click's "Error: ..."
    assert "gateway at" not in result.stdout  # stopped before starting the mock backend and the gateway
    assert not out.exists()
