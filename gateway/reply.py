"""The one HTTP answer of a data-plane request, sent over ASGI: its head, its body in parts (a stream) or in one
piece, and where it stands (started, sized, ended). Every send is bounded: a client that does not read is not
waited for past the write timeout, nor past its rollout's deadline."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from rollway.gateway.bounds import Bound
from rollway.gateway.errors import CallError, ClientStalled

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]


class Reply:
    """Sends one HTTP response over ASGI, remembering whether it started.

    A send waits while the client does not read (uvicorn's flow control: the backend's answer is not piled up in
    memory), but not for ever: one that waits ``write_timeout`` seconds, or past ``deadline`` (the rollout's, wall
    clock), raises ``ClientStalled`` (``bound``: the handler task's, kept by the gateway's ``Sweeper``)."""

    def __init__(self, send: Send, write_timeout: float, bound: Bound) -> None:
        self._send = send
        self.started = False
        self.sized = False  # a whole answer (its length said): nothing may be added to it
        self.ended = False
        self.write_timeout = write_timeout
        self.deadline: float | None = None
        self.bound = bound

    async def _put(self, message: Message) -> None:
        try:
            with self.bound.within(self.write_timeout, self.deadline):
                await self._send(message)
        except TimeoutError:
            if self.deadline is not None and time.time() >= self.deadline:
                raise ClientStalled("the client did not read the answer before the rollout's deadline") from None
            raise ClientStalled(f"the client did not read the answer for {self.write_timeout:g} s") from None

    async def start(self, status: int, headers: Headers) -> None:
        self.started = True
        await self._put({"type": "http.response.start", "status": status, "headers": headers})

    async def body(self, data: bytes, more: bool) -> None:
        self.ended = self.ended or not more
        await self._put({"type": "http.response.body", "body": data, "more_body": more})

    async def whole(self, status: int, headers: Headers, data: bytes) -> None:
        """A response in one piece, with its length (not chunked: an HTTP/1.0 client cannot read chunks)."""
        self.sized = True
        await self.start(status, [*headers, (b"content-length", str(len(data)).encode())])
        await self.body(data, more=False)

    async def error(self, err: CallError, headers: Headers) -> None:
        """``err`` as the answer: whole if nothing was sent yet (``headers`` and the error's own, JSON unless the
        error is a backend's body with its own type); a stream that started ends with it as its last event; an
        answer already whole or ended gets nothing more."""
        if not self.started:
            own = {name for name, _ in err.headers}
            out = [*(h for h in headers if h[0] not in own), *err.headers]
            if b"content-type" not in own:
                out.insert(0, (b"content-type", b"application/json"))
            await self.whole(err.status, out, err.body)
        elif not self.sized and not self.ended:
            await self.body(b"data: " + err.body + b"\n\n", more=False)
