"""The real components some suites need (a vLLM, nginx, Chromium, the Agent-lightning environment): a module whose
component is missing is skipped whole, with one line saying why, unless CI says the suite must run (its
``ROLLWAY_REQUIRE_*`` variable is 1), when it fails instead. Such suites are marked ``real_component``, so that
``pytest -m "not real_component"`` leaves them out where the components are there too."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NoReturn

import pytest


def missing(suite: str, variable: str, reason: str) -> NoReturn:
    """Called where a test module is imported, when ``suite``'s component is missing for ``reason``."""
    if os.environ.get(variable) == "1":
        pytest.fail(f"{suite} required ({variable}=1) but {reason}", pytrace=False)
    pytest.skip(f"{suite} skipped: {reason}", allow_module_level=True)


def marked_ready(marker: Path, spec: str) -> bool:
    """Whether a cached environment's ready marker (JSON with its ``spec``) says it holds ``spec``."""
    try:
        return bool(json.loads(marker.read_text()).get("spec") == spec)
    except (OSError, ValueError, AttributeError):
        return False
