"""What the Docker image is built from: the Dockerfile copies every package the wheel is made of and every
first-party package their code imports (no Docker daemon here, so the build context is checked, not built)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _copied() -> set[str]:
    """The sources of the Dockerfile's ``COPY`` lines (all but the last word of each)."""
    sources: set[str] = set()
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"]:
            sources.update(w.rstrip("/") for w in words[1:-1] if not w.startswith("--"))
    return sources


def _first_party_imports(package: str) -> set[str]:
    local = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    names: set[str] = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
    return names & local


def test_the_image_gets_every_package_of_the_wheel_and_what_they_import() -> None:
    wheel = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]
    )
    copied = _copied()
    assert {"pyproject.toml", "README.md"} <= copied  # the build reads both
    assert wheel <= copied, f"the Dockerfile does not copy {sorted(wheel - copied)}"
    for package in sorted(wheel):
        missing = _first_party_imports(package) - copied
        assert not missing, f"{package}/ imports {sorted(missing)}, which the image does not get"
