"""The README runs as written: each of its Python snippets is saved to a file and run as a script (as the README
says to), and its "A model" commands are typed into a shell, against a real ``rollway serve`` on a loopback port
in front of the mock backend, the engine a machine without a GPU has."""

from __future__ import annotations

import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rollway.mock import MockBackendProcess
from rollway.process import GatewayProcess

README = Path(__file__).resolve().parents[1] / "README.md"
BIN = Path(sys.executable).parent


def blocks(language: str, under: str | None = None) -> list[str]:
    """The README's fenced ``language`` blocks (those of section ``under`` only, when given)."""
    text = README.read_text()
    if under is not None:
        start = text.index(f"## {under}\n")
        end = text.find("\n## ", start + 1)
        text = text[start : end if end != -1 else None]
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[GatewayProcess]:
    with GatewayProcess(f"sqlite:///{tmp_path / 'readme.db'}") as process:
        yield process


def run(command: list[str], cwd: Path, server: GatewayProcess) -> subprocess.CompletedProcess[str]:
    env = {"PATH": f"{BIN}:/usr/bin:/bin", "ROLLWAY_URL": server.url, "HOME": str(cwd)}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_the_python_snippets_are_scripts_that_run(
    tmp_path: Path, server: GatewayProcess, mock: MockBackendProcess
) -> None:
    snippets = blocks("python")
    assert len(snippets) == 2  # an agent, the store from Python: a new one is run here too
    backend = {"base_url": mock.base_url, "kind": "vllm", "model": "mock-model"}
    httpx.put(f"{server.url}/admin/v1/models/policy", json={"backends": [backend]}, timeout=30).raise_for_status()
    outputs = []
    for n, snippet in enumerate(snippets):
        script = tmp_path / f"snippet_{n}.py"
        script.write_text(snippet)
        done = run([sys.executable, str(script)], tmp_path, server)
        assert done.returncode == 0, f"README snippet {n} failed:\n{snippet}\n{done.stdout}\n{done.stderr}"
        outputs.append(done.stdout.splitlines())
    agent, store = outputs
    # The agent's four rollouts, each with the engine's token ids and its reward.
    assert len(agent) == 4 and all(line.endswith(" 1.0") and "[" in line for line in agent), agent
    assert store == ["succeeded []"]
    assert (tmp_path / "rollway.db").exists()


def test_a_model_works_without_a_gpu(tmp_path: Path, server: GatewayProcess, mock: MockBackendProcess) -> None:
    [commands] = blocks("bash", under="A model")
    assert "rollway mock-backend" in commands
    lines = [line.split("#")[0].strip() for line in commands.splitlines()]
    typed = [line for line in lines if line.startswith("rollway models")]
    assert len(typed) == 2
    for line in typed:
        # The session's mock backend stands in for the one the README starts on port 8001.
        argv = shlex.split(line.replace("http://127.0.0.1:8001/v1", mock.base_url))
        done = run([str(BIN / argv[0]), *argv[1:]], tmp_path, server)
        assert done.returncode == 0, done.stdout + done.stderr
    assert "vllm" in done.stdout and "policy" in done.stdout
    answer = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": "policy", "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("kind", [[], ["--kind", "vllm"]], ids=["auto", "vllm"])
def test_a_backend_that_does_not_answer_is_stored_with_a_warning(
    tmp_path: Path, server: GatewayProcess, kind: list[str]
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]  # released: nothing listens there
    put = ["models", "put", "later", "--backend", f"http://127.0.0.1:{closed}/v1", "--model", "m", *kind]
    done = run([str(BIN / "rollway"), *put], tmp_path, server)
    assert done.returncode == 0, done.stderr
    assert f"warning: the backend http://127.0.0.1:{closed}/v1 did not answer" in done.stderr
    assert httpx.get(f"{server.url}/admin/v1/models/later", timeout=30).status_code == 200
    fine = run([str(BIN / "rollway"), "models", "list"], tmp_path, server)
    assert "warning" not in fine.stderr
    assert "down" in fine.stdout.split()  # and the table says so


def test_serve_says_where_the_dashboard_is(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with GatewayProcess(f"sqlite:///{tmp_path / 'ui.db'}", port=port) as server:
        assert f"rollway: the dashboard is at {server.url}/ui" in list(server.output)
        assert httpx.get(f"{server.url}/ui", timeout=30).status_code == 200
    # Bound to every interface: the address given is one this machine's browser opens.
    with GatewayProcess(f"sqlite:///{tmp_path / 'ui.db'}", host="0.0.0.0", port=port, admin_token="t") as server:
        assert f"rollway: the dashboard is at http://127.0.0.1:{port}/ui" in list(server.output)
