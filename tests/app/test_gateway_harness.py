"""The test harness's own promises (``support.gateway_harness``): what a test that uses it can count on."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from support import gateway_harness
from support.gateway_harness import GatewayDidNotStart, running_gateway


async def test_a_gateway_that_fails_to_start_raises_and_closes_its_listening_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store that cannot be opened fails the application's start: the test gets an error at once (not a
    ``/healthz`` that waits 30 s, nor uvicorn's ``sys.exit`` out of the event loop) and the port is released."""
    opened: list[socket.socket] = []

    def listening_socket(send_buffer: int | None = None) -> socket.socket:
        opened.append(real(send_buffer))
        return opened[-1]

    real = gateway_harness.listening_socket
    monkeypatch.setattr(gateway_harness, "listening_socket", listening_socket)
    with pytest.raises(GatewayDidNotStart):
        async with running_gateway(tmp_path, database_url=f"sqlite:///{tmp_path / 'missing' / 'gateway.db'}"):
            raise AssertionError("the gateway started")
    [sock] = opened
    assert sock.fileno() == -1  # closed
