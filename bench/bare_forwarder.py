"""The baseline for the gateway benchmark: uvicorn (uvloop, httptools) + the same aiohttp client as Rollway,
forwarding POST bodies to one upstream and the answers back — no parsing, no attribution, no recording.

    python bench/bare_forwarder.py --port 9100 --upstream http://127.0.0.1:8001 [--record FILE]

With ``--record`` it also writes every call to a SQLite file the way the product's contract asks and no more:
a sequence number taken in its own transaction when the call arrives, and the request and answer bytes
(unparsed) committed before the answer is sent — WAL, ``synchronous=NORMAL``, 16 KiB pages, as Rollway's store.
That is the floor of durable recording on SQLite, to set Rollway's CPU per call against.
"""

from __future__ import annotations

import argparse
import socket
import sqlite3
from typing import Any

import aiohttp
import uvicorn


class Recorder:
    """Durable recording with nothing but the two transactions (see the module docstring)."""

    NEXT = (
        "INSERT INTO sequences (attempt, last) VALUES (?, 1) "
        "ON CONFLICT (attempt) DO UPDATE SET last = last + 1 RETURNING last"
    )
    INSERT = "INSERT INTO calls (attempt, sequence, request, response) VALUES (?, ?, ?, ?)"

    def __init__(self, path: str) -> None:
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        for pragma in ("page_size=16384", "journal_mode=WAL", "synchronous=NORMAL"):
            self.db.execute(f"PRAGMA {pragma}")
        self.db.execute("CREATE TABLE IF NOT EXISTS sequences (attempt TEXT PRIMARY KEY, last INTEGER NOT NULL)")
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS calls (attempt TEXT, sequence INTEGER, request BLOB, response BLOB, "
            "PRIMARY KEY (attempt, sequence))"
        )

    def arrive(self, attempt: str) -> int:
        self.db.execute("BEGIN IMMEDIATE")
        (sequence,) = self.db.execute(self.NEXT, (attempt,)).fetchone()
        self.db.execute("COMMIT")
        return int(sequence)

    def record(self, attempt: str, sequence: int, request: bytes, response: bytes) -> None:
        self.db.execute("BEGIN IMMEDIATE")
        self.db.execute(self.INSERT, (attempt, sequence, request, response))
        self.db.execute("COMMIT")


def make_app(upstream: str, announce: bool = False, recorder: Recorder | None = None) -> Any:
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
        if recorder is not None:
            await forward_recorded(session, upstream + scope["path"], body, send, recorder)
            return
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


async def forward_recorded(
    session: aiohttp.ClientSession, url: str, body: bytes, send: Any, recorder: Recorder
) -> None:
    sequence = recorder.arrive("bench")  # the benchmark's calls all belong to one attempt
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
        answer = await r.read()
        content_type = r.headers.get("Content-Type", "").encode()
    recorder.record("bench", sequence, body, answer)
    await send({"type": "http.response.start", "status": r.status, "headers": [(b"content-type", content_type)]})
    await send({"type": "http.response.body", "body": answer, "more_body": False})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--record", metavar="FILE", help="write every call durably to this SQLite file")
    parser.add_argument("--announce", action="store_true", help="print a line once listening")
    args = parser.parse_args()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.port))
    sock.listen(1024)  # listening before "forwarding" is printed: a client may connect at once
    config = uvicorn.Config(
        make_app(args.upstream.rstrip("/"), args.announce, Recorder(args.record) if args.record else None),
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
    )
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
