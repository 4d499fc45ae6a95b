"""The type check: mypy over every source file of the repository, each under the one name Python imports it by.

mypy names a file after its path (``gateway/proxy.py`` would be ``gateway.proxy``) and follows neither
setuptools' ``package-dir`` mapping nor the import hook an editable install puts in its place, so given the
folders it cannot find ``rollway.gateway``. This script hands mypy the files itself, each with its installed
module name read from that mapping in ``pyproject.toml`` (``gateway/proxy.py`` is ``rollway.gateway.proxy``,
``rollway/app/factory.py`` is ``rollway.app.factory``). Imports between them resolve within the build: mypy
searches the disk only for modules not handed to it. Errors name the real file, ``gateway/proxy.py``.

Besides the package it checks the folders of scripts, ``examples/``, ``bench/`` and ``tools/``, where a file's
module name is its path in the folder (``bench/gateway_bench.py`` is ``gateway_bench``, as the scripts import each
other), and ``tests/`` (``--no-tests`` leaves it out) under the names pytest imports its files by: importlib mode
names a module by its path from the root (``tests/gateway/test_x.py`` is ``tests.gateway.test_x``), and
``tests/support/`` is the package ``support`` (``tests/`` is on ``sys.path``). The override for ``tests.*`` and
``support.*`` in ``pyproject.toml`` relaxes the settings there. ``mypy.main.run_build`` is the function
mypy's own command line runs the build and prints errors with.

All other settings are ``[tool.mypy]``'s, read by mypy's own option parser; other arguments are passed to it::

    python tools/typecheck.py                  # what CI runs
    python tools/typecheck.py --no-tests       # without tests/
    python tools/typecheck.py --no-incremental # any flag of mypy's (no files: the list is this script's)
"""

from __future__ import annotations

import os
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

from mypy import util
from mypy.fscache import FileSystemCache
from mypy.main import process_options, run_build
from mypy.modulefinder import BuildSource

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("examples", "bench", "tools")  # folders of scripts, checked by default
TESTS = "tests"
SUPPORT = "support"  # tests/support/: the package the tests share, imported as ``support``


def package_folders(root: Path = ROOT) -> dict[str, Path]:
    """Each package of ``[tool.setuptools] package-dir`` and the folder it is built from."""
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {package: root / folder for package, folder in setuptools["package-dir"].items()}


def _python_files(folder: Path) -> Iterator[Path]:
    for path in sorted(folder.rglob("*.py")):
        if "__pycache__" not in path.relative_to(folder).parts:
            yield path


def _name(prefix: tuple[str, ...], relative: Path) -> str:
    return ".".join((*prefix, *relative.with_suffix("").parts)).removesuffix(".__init__")


def package_modules(root: Path = ROOT) -> dict[Path, str]:
    """Every file of the package and its module name. A folder mapped inside another mapped folder is named from
    its own mapping (the deepest folder wins)."""
    found: dict[Path, tuple[int, str]] = {}
    for package, folder in package_folders(root).items():
        for path in _python_files(folder):
            depth = len(folder.parts)
            if path not in found or found[path][0] < depth:
                found[path] = (depth, _name(tuple(package.split(".")), path.relative_to(folder)))
    return {path: name for path, (_, name) in sorted(found.items())}


def script_modules(folder: Path) -> dict[Path, str]:
    """Every file under a folder of scripts (or tests) and its module name: its path in the folder."""
    return {path: _name((), path.relative_to(folder)) for path in _python_files(folder)}


def test_modules(folder: Path) -> dict[Path, str]:
    """Every file under ``tests/`` and the name pytest imports it by: ``tests/gateway/test_x.py`` is
    ``tests.gateway.test_x`` (importlib mode names a module by its path from the root), and ``tests/support/`` is
    the package ``support`` (``tests/`` is on ``sys.path``, and the tests import ``support.*``)."""
    support = folder / SUPPORT
    named = {path: _name((TESTS,), path.relative_to(folder)) for path in _python_files(folder)}
    named.update({path: _name((SUPPORT,), path.relative_to(support)) for path in _python_files(support)})
    return named


def sources(root: Path = ROOT, *, tests: bool = True) -> list[BuildSource]:
    """What mypy checks: the package, the scripts and (``tests``) the tests, paths relative to ``root``."""
    modules = package_modules(root)
    for folder in SCRIPTS:
        modules.update(script_modules(root / folder))
    if tests:
        modules.update(test_modules(root / TESTS))
    names: dict[str, Path] = {}
    for path, name in modules.items():
        if name in names:
            raise SystemExit(f"typecheck: {path} and {names[name]} are both module {name}")
        names[name] = path
    return [BuildSource(str(path.relative_to(root)), name, base_dir=str(root)) for path, name in modules.items()]


def main(argv: list[str]) -> int:
    t0 = time.time()
    tests = "--no-tests" not in argv
    flags = [arg for arg in argv if arg != "--no-tests"]
    os.chdir(ROOT)  # mypy finds pyproject.toml here, and prints paths relative to it
    fscache = FileSystemCache()
    listed, options = process_options(flags, require_targets=False, fscache=fscache)
    if listed:
        raise SystemExit("typecheck: give no files or modules: the list is this script's (see its docstring)")
    build = sources(tests=tests)
    _, messages, blockers = run_build(build, options, fscache, t0, sys.stdout, sys.stderr)
    n_errors, n_notes, n_files = util.count_stats(messages)
    formatter = util.FancyFormatter(sys.stdout, sys.stderr, options.hide_error_codes)
    if n_errors:
        summary = formatter.format_error(
            n_errors, n_files, len(build), blockers=blockers, use_color=options.color_output
        )
    else:
        summary = formatter.format_success(len(build), options.color_output)
    print(summary)
    return (2 if blockers else 1) if messages and n_notes < len(messages) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
