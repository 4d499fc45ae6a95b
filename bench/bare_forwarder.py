"""The baseline for the gateway benchmark: uvicorn (uvloop, httptools) + the same aiohttp client as Rollway,
forwarding POST bodies to one upstream and the answers back — no parsing, no attribution, no recording.

    python bench/bare_forwarder.py --port 9100 --upstream http://127.0.0.1:8001
"""

from __future__ import annotations

import argparse
import socket
from typing import Any

import aiohttp
import uvicorn


def make_app(upstream: str, announce: bool = False) -> Any:
    session: aiohttp.ClientSession | None = None

    async def app(scope: Any, receive: Any, send: Any) -> None:
        nonlocal session
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
                    await send({"type": "lifespan.startup.complete"})
                    if announce:  # the socket is listening already (bound before uvicorn started)
                        print("forwarding", flush=True)
                elif message["type"] == "lifespan.shutdown":
                    assert session is not None
                    await session.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        assert session is not None
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        async with session.post(
            upstream + scope["path"], data=body, headers={"Content-Type": "application/json"}
        ) as response:
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status,
                    "headers": [(b"content-type", response.headers.get("Content-Type", "").encode())],
                }
            )
            async for chunk in response.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--announce", action="store_true", help="print a line once listening")
    args = parser.parse_args()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.port))
    sock.listen(1024)  # listening before "forwarding" is printed: a client may connect at once
    config = uvicorn.Config(
        make_app(args.upstream.rstrip("/"), args.announce),
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
    )
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
