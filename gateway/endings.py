"""What a call's client is sent once its span is written: the last part of its answer.

A call's answer goes out as it comes, but its end waits for the span (``Call.run``): a completion is handed over
only once it is on disk. Each way a call ends leaves one ``Ending``; ``send`` gets whether the store withheld the
completion (its span could not be written: ``outcome.withhold``), and then sends the error instead.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

from rollway.gateway.errors import CallError, ClientStalled
from rollway.gateway.outcome import not_recorded_error
from rollway.gateway.reply import Headers, Reply


class Ending(Protocol):
    async def send(self, reply: Reply, withheld: bool) -> None: ...


@dataclass
class WholeAnswer:
    """The backend's whole answer, passed on; a completion whose span is not on disk is a 503 instead."""

    status: int
    content_type: bytes
    headers: Headers  # the call's own (its ids)
    body: bytes

    async def send(self, reply: Reply, withheld: bool) -> None:
        if withheld:
            await reply.error(not_recorded_error(), self.headers)
        else:
            await reply.whole(self.status, [(b"content-type", self.content_type), *self.headers], self.body)


@dataclass
class StreamEnd:
    """The last event of a relayed stream: ``[DONE]``, the Responses API's last event (the whole response), an
    error event, or nothing. A stream whose span is not on disk ends in the ``not_recorded`` error event instead:
    its tokens went by, but the client must not take them as a completion."""

    last: bytes

    async def send(self, reply: Reply, withheld: bool) -> None:
        if withheld:
            await reply.body(b"data: " + not_recorded_error().body + b"\n\n", more=False)
        else:
            await reply.body(self.last, more=False)


@dataclass
class ErrorAnswer:
    """The call's error: the whole answer when nothing was sent yet, else the stream's last event. With
    ``patience`` (the server is stopping) the client is given that long to take it, and no longer."""

    err: CallError
    headers: Headers
    patience: float | None = None

    async def send(self, reply: Reply, withheld: bool) -> None:
        if self.patience is None:
            await reply.error(self.err, self.headers)
            return
        reply.write_timeout = min(reply.write_timeout, self.patience)
        with contextlib.suppress(ClientStalled):
            await reply.error(self.err, self.headers)


class NoAnswer:
    """The client left: nobody to tell."""

    async def send(self, reply: Reply, withheld: bool) -> None:
        return None


@dataclass
class Abandoned:
    """The client stopped reading: the answer is left unfinished, and ``ClientStalled`` goes on to the ASGI layer,
    which leaves the connection to close."""

    stall: ClientStalled

    async def send(self, reply: Reply, withheld: bool) -> None:
        raise self.stall
