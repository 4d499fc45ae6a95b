"""A mock inference backend that behaves like vLLM's OpenAI-compatible server, or SGLang's
(``MockConfig(flavor="sglang")``), for tests, demos and benchmarks.

``create_mock_app(MockConfig(...))`` is the Starlette app; ``MockBackendProcess`` runs ``rollway mock-backend`` in
a subprocess and ``run_in_thread`` serves the app in this process; both expose ``base_url`` (ending in ``/v1``).
"""

from rollway.mock.app import create_mock_app
from rollway.mock.config import MockConfig
from rollway.mock.faults import FaultRule
from rollway.mock.server import MockBackendProcess, MockServer, run_in_thread, serve
from rollway.mock.state import MockState

__all__ = [
    "FaultRule",
    "MockBackendProcess",
    "MockConfig",
    "MockServer",
    "MockState",
    "create_mock_app",
    "run_in_thread",
    "serve",
]
