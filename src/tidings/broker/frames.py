"""The data port's framing, shared by replication (`transport.py`), clients' calls on the broker side
(`transport_rpc.py`) and on the client side (`tidings.client._wire`).

A frame is ``!IIB`` (payload length, stream id, kind), then the payload. Kinds: HELLO opens a
connection; REQUEST, RESPONSE, CLOSE_SEND, END and RESET carry a stream; PING and PONG keep a
connection alive; OPEN starts a client's call and WINDOW grants a call's sender more room
(`transport_rpc.py`).
"""

from __future__ import annotations

import asyncio
import collections
import struct
from typing import Generic, Protocol, TypeVar

import grpc

HEADER = struct.Struct("!IIB")  # payload length, stream id, kind
MAX_FRAME = 65 * 1024 * 1024  # a ReplicateRequest carries at most one client message (64 MiB) and a proposal
HELLO, REQUEST, RESPONSE, CLOSE_SEND, END, RESET, PING, PONG, OPEN, WINDOW = range(10)
INITIAL_WINDOW = 64 * 1024  # payload bytes a call's sender may first have unconsumed on the other side (each way)
CALL_WINDOW = 1024 * 1024  # what a window opens to once its receiver consumes (a waiting call holds the initial one)
GRANT = struct.Struct("!I")  # a WINDOW's payload: the bytes consumed since the last grant
_END_STATUS = struct.Struct("!B")
M = TypeVar("M")


class StreamError(Exception):
    """A stream failed (the other side went away, refused the stream, or the connection broke)."""


def end_payload(code: grpc.StatusCode, message: str) -> bytes:
    """An END's payload for a failure: the gRPC code, then the message."""
    return _END_STATUS.pack(code.value[0]) + message.encode()


def end_status(payload: bytes) -> tuple[grpc.StatusCode, str]:
    """(code, message) of an END's payload (empty: OK)."""
    if not payload:
        return grpc.StatusCode.OK, ""
    code = next((c for c in grpc.StatusCode if c.value[0] == payload[0]), grpc.StatusCode.UNKNOWN)
    return code, payload[1:].decode(errors="replace")


class Inbox:
    """The receiving half both ends of a stream share: one receiver waits until the connection
    delivers something (or the stream ends) and is woken then."""

    _waiter: asyncio.Future[None] | None = None

    async def _delivery(self) -> None:
        if self._waiter is not None:
            raise RuntimeError("already awaited by another task: one receiver (or sender) per stream at a time")
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class Credit(Inbox):
    """What a call's sender may still send before the other side consumes some (its window): a send
    waits while none is left, then may overdraw it by one message (so any message fits a window)."""

    def __init__(self) -> None:
        self.left = INITIAL_WINDOW

    def grant(self, size: int) -> None:
        self.left += size
        if self.left > 0:
            self._wake()

    async def wait(self) -> None:
        """Until there is room, or `fail()` (the sender then checks its call before sending)."""
        if self.left <= 0:
            await self._delivery()

    def fail(self) -> None:
        """The call ended: wake a waiting sender (it finds out from its call)."""
        self._wake()


class Grants:
    """The receiving side of a call's window: counts what its user consumed and says when to send a
    WINDOW (a quarter of the window at a time, so a stream of small messages costs few frames). The
    window starts at INITIAL_WINDOW and opens to CALL_WINDOW with the first grant: a call that waits
    (an append queued behind another) holds little, one being served streams. (Doubling per grant
    made a 1 MiB append, sent in 256 KiB chunks, wait a round trip per chunk while it held its
    journal's pipeline.) An append a non-primary broker proxies is consumed before the primary serves
    it, so it holds up to CALL_WINDOW there while it waits: CLIENT_INBOUND_HIGH bounds them all."""

    __slots__ = ("owed", "room", "window")

    def __init__(self) -> None:
        self.owed = 0  # consumed, not granted yet
        self.window = INITIAL_WINDOW
        self.room = INITIAL_WINDOW  # what the sender may still send, as far as the grants sent say

    def received(self, size: int) -> bool:
        """A message of `size` bytes arrived; false if its sender had no room left to send it."""
        if self.room <= 0:
            return False
        self.room -= size
        return True

    def consumed(self, size: int) -> int:
        """Bytes to grant now (0: not yet)."""
        self.owed += size
        if self.owed < self.window // 4:
            return 0
        grant, self.owed = self.owed, 0
        if self.window < CALL_WINDOW:
            grant += CALL_WINDOW - self.window
            self.window = CALL_WINDOW
        self.room += grant
        return grant


class InboundCounter(Protocol):
    """A connection's count of bytes delivered to its streams and not yet consumed (it stops reading
    above a limit)."""

    def delivered(self, size: int) -> None: ...

    def consumed(self, size: int) -> None: ...


class Inbound(Inbox, Generic[M]):
    """The requests a connection delivered to one stream and its handler has not taken yet, counted
    towards the connection's inbound limit (replication's streams, clients' calls alike)."""

    def __init__(self, counter: InboundCounter) -> None:
        self._counter = counter
        self._requests: collections.deque[tuple[M, int]] = collections.deque()
        self._inbound = 0
        self._eof = False

    def _queue(self, msg: M, size: int, first: bool = False) -> None:
        (self._requests.appendleft if first else self._requests.append)((msg, size))
        self._inbound += size
        self._counter.delivered(size)
        self._wake()

    def _end_of_stream(self) -> None:
        self._eof = True
        self._wake()

    def take_inbound(self) -> int:
        """Forget what is left (the handler ended); the bytes to give back to the connection."""
        size, self._inbound = self._inbound, 0
        self._requests.clear()
        return size

    def _check(self) -> None:
        """Raise if the stream failed (checked before each wait)."""

    async def _next_request(self) -> M | None:
        """The next request, None after the end of stream."""
        while not self._requests:
            self._check()
            if self._eof:
                return None
            await self._delivery()
        msg, size = self._requests.popleft()
        self._inbound -= size
        self._counter.consumed(size)
        self._taken(size)
        return msg

    def _taken(self, size: int) -> None:
        """The handler took a request of `size` bytes (a call grants its client room again)."""
