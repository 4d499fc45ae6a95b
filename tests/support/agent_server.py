"""The example Osmosis agent server (``examples/remote_agent_server.py``) as a real child process on a free
loopback port, for the remote-agent tests."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import httpx

from rollway.process import ServerProcess

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "remote_agent_server.py"


class AgentServerProcess(ServerProcess):
    name = "agent server"

    def __init__(self, *args: str) -> None:
        super().__init__(["--port", "0", *args])

    def command(self) -> list[str]:
        return [sys.executable, str(EXAMPLE), *self.args]

    def health(self) -> dict[str, Any]:
        answer: dict[str, Any] = httpx.get(f"{self.url}/health", timeout=10).json()
        return answer
