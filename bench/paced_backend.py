"""A paced backend for load benchmarks: it answers every chat-completions call with answers the mock backend gave
once (token ids and logprobs included), a streamed one an event per decode step, ``--token-delay-ms`` apart, a
non-streamed one after ``--latency-ms``. One timer steps every stream at once, as an engine's decode step emits a
token for every running sequence; with no HTTP framework and the events encoded in advance it costs a few
microseconds per event, so that on a small machine the proxies in front of it, not the backend, reach their limit
first (the Python mock paces each stream with a timer of its own and saturates a core near 500 paced streams).

    python bench/paced_backend.py --port 9200 --answers DIR [--token-delay-ms 20] [--latency-ms 500]

``DIR`` holds ``chat.json`` (a whole answer) and ``stream.sse`` (a streamed one, as the mock sent it).
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

import orjson

NOT_FOUND = b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Backend:
    def __init__(self, answers: Path, token_delay: float, latency: float) -> None:
        whole = (answers / "chat.json").read_bytes()
        self.whole = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
            len(whole),
            whole,
        )
        events = [e + b"\n\n" for e in (answers / "stream.sse").read_bytes().split(b"\n\n") if e.strip()]
        self.head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        self.steps = [chunk(e) for e in events[:-1]]
        self.last = chunk(events[-1]) + b"0\r\n\r\n"  # the [DONE] event with the previous one's step
        self.token_delay, self.latency = token_delay, latency
        self.streams: dict[Any, int] = {}  # transport -> the next step

    async def tick(self) -> None:
        """Every ``token_delay``: the next event of every stream, in one pass."""
        loop = asyncio.get_running_loop()
        due = loop.time()
        steps, last = self.steps, self.last
        while True:
            due += self.token_delay
            await asyncio.sleep(max(0.0, due - loop.time()))
            streams = self.streams
            for transport, step in list(streams.items()):
                if transport.is_closing():
                    del streams[transport]
                elif step + 1 < len(steps):
                    transport.write(steps[step])
                    streams[transport] = step + 1
                else:
                    transport.write(steps[step] + last)
                    del streams[transport]


class Connection(asyncio.Protocol):
    def __init__(self, backend: Backend) -> None:
        self.backend, self.buffer = backend, b""
        self.transport: Any = None  # (uvloop's transports are not ``asyncio.Transport``s)

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            cut = self.buffer.find(b"\r\n\r\n")
            if cut < 0:
                return
            head = self.buffer[:cut].lower()
            at = head.find(b"content-length:")
            length = int(head[at + 15 :].split(b"\r\n", 1)[0]) if at >= 0 else 0
            if len(self.buffer) < cut + 4 + length:
                return
            body, self.buffer = self.buffer[cut + 4 : cut + 4 + length], self.buffer[cut + 4 + length :]
            if head.startswith(b"post"):
                self.answer(orjson.loads(body) if body else {})
            else:  # (a gateway's probes, e.g. for the engine's weight version: there is none here)
                self.transport.write(NOT_FOUND)

    def answer(self, body: dict[str, Any]) -> None:
        backend, transport = self.backend, self.transport
        if body.get("stream"):
            transport.write(backend.head)
            backend.streams[transport] = 0
        else:
            asyncio.get_running_loop().call_later(
                backend.latency, lambda: transport.is_closing() or transport.write(backend.whole)
            )

    def connection_lost(self, exc: Exception | None) -> None:
        self.backend.streams.pop(self.transport, None)


async def serve(args: argparse.Namespace) -> None:
    backend = Backend(Path(args.answers), args.token_delay_ms / 1000, args.latency_ms / 1000)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Connection(backend), "127.0.0.1", args.port, backlog=4096)
    print("serving", flush=True)
    async with server:
        await backend.tick()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--answers", required=True)
    parser.add_argument("--token-delay-ms", type=float, default=20.0)
    parser.add_argument("--latency-ms", type=float, default=500.0)
    args = parser.parse_args()
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(args))
    else:
        uvloop.run(serve(args))


if __name__ == "__main__":
    main()
