"""Clients' RPCs on the broker's data port: the Journal service's methods over `transport.py`'s framing.

A client connection opens with HELLO `tidings-client/1` (over TLS: ALPN `tidings-client/1`, mutual as
the port's replication connections are) and then multiplexes calls, one stream each, numbered upwards
by the client:

- **OPEN** (client): `!BH` (method, token length), the token (its `authorization` bearer, as gRPC's
  metadata carries it), then the call's first request message (an Append's first AppendRequest).
- **REQUEST** (client): an Append's further AppendRequests; **CLOSE_SEND**: its end of stream.
- **RESPONSE** (broker): a response message (one for a unary call, any number for Read and List).
- **END** (broker): the call's status: empty for OK, else `!B` gRPC code and the details.
- **RESET** (client): the call is cancelled (an Append then rolls back, as a cancelled gRPC call).
- **WINDOW** (either): `!I`, bytes of the call's messages its receiver consumed: room to send more.

**Flow control per call**, as HTTP/2's: each side of a call may have at most `CALL_WINDOW` bytes of
messages unconsumed by the other (and overdraw it by one message), and gets room back by WINDOW frames
as the other side's user consumes them. So a call whose handler or caller is slow (an append waiting for
its journal's pipeline, a Read nobody iterates) holds only its window, never the connection: a broker
reads a client's connection at all times, and a RESET is heard at once, behind at most the windows of
the calls before it. A client that sends past its window is a broken client: its connection is closed.
A connection's memory is bounded by its calls times their windows.

The broker serves each call with the same `_Servicer` method gRPC calls (`service.py`), through a
`Context` that offers what they use of grpc.aio's ServicerContext (`read`, `write`, `abort`, `code`,
`invocation_metadata`, `peer`): one handler per RPC for both transports, so capability checks, proxying
and every status are the same. A call's requests count towards the connection's inbound limit as
a response waits for room in the call's window, then for the socket buffer to drain.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import grpc
from google.protobuf.message import Message

from tidings.broker.frames import (
    CALL_WINDOW,
    END,
    GRANT,
    RESPONSE,
    WINDOW,
    Credit,
    Grants,
    Inbound,
    StreamError,
    end_payload,
)
from tidings.protocol import protocol_pb2 as pb
from tidings.tasks import cancelled_under_us

if TYPE_CHECKING:
    from tidings.broker.transport import _PeerConnection

log = logging.getLogger(__name__)

CLIENT_HELLO = b"tidings-client/2"
CLIENT_ALPN = "tidings-client/2"
OPEN_HEAD = struct.Struct("!BH")  # method, token length


@dataclass(frozen=True, slots=True)
class Method:
    """One Journal RPC as the data port serves it: its number on the wire, its servicer method, its
    request and response types, and its shape."""

    number: int
    name: str
    request: type[Message]
    response: type[Message]
    client_streaming: bool = False
    server_streaming: bool = False


METHODS = {
    m.number: m
    for m in (
        Method(1, "Append", pb.AppendRequest, pb.AppendResponse, client_streaming=True),
        Method(2, "Read", pb.ReadRequest, pb.ReadResponse, server_streaming=True),
        Method(3, "List", pb.ListRequest, pb.ListResponse, server_streaming=True),
        Method(4, "ListFragments", pb.FragmentsRequest, pb.FragmentsResponse),
        Method(5, "Apply", pb.ApplyRequest, pb.ApplyResponse),
        Method(6, "ListMembers", pb.MembersRequest, pb.MembersResponse),
    )
}
BY_NAME = {m.name: m for m in METHODS.values()}


class Context:
    """What a `_Servicer` method uses of grpc.aio's ServicerContext, for one call on the data port."""

    def __init__(self, call: RpcStream, token: str, peer: str) -> None:
        self._call = call
        self._metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self._peer = peer
        self._code: grpc.StatusCode | None = None
        self.details = ""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def code(self) -> grpc.StatusCode | None:
        return self._code

    async def read(self) -> Any:
        return await self._call.read()

    async def write(self, message: Message) -> None:
        await self._call.respond(message)

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        self._code, self.details = code, details
        raise grpc.aio.AbortError()


Servicer = Any  # (service.py's _Servicer: a method per RPC, by name)


class RpcStream(Inbound[Message]):
    """The broker's end of one client call: its requests, its responses, its END."""

    def __init__(self, conn: _PeerConnection, sid: int, method: Method) -> None:
        super().__init__(conn)
        self.conn, self.sid, self.method = conn, sid, method
        self.task: asyncio.Task[None] | None = None
        self.ended = False
        self.credit = Credit()  # room in the client's window for our responses
        self._grants = Grants()  # what the handler consumed of the client's requests, to give back

    # -- from the connection ------------------------------------------------------------------

    def accept(self, first: Message, size: int) -> None:
        """The call's first message (an Append's is read as its first request), counted as any request."""
        if self.method.client_streaming:
            self._queue(first, size, first=True)

    def deliver(self, payload: memoryview, size: int) -> bool:
        """A request arrived (parsed here: a DecodeError closes the connection, as a replication frame's);
        false if the client had no room left to send it (the connection is then closed)."""
        if self._inbound + self._grants.owed >= CALL_WINDOW:
            return False
        self._queue(self.method.request.FromString(payload), size)  # type: ignore[arg-type]  # parses any buffer
        return True

    def reset(self) -> None:
        """The client cancelled the call, or the connection went: the handler is cancelled."""
        self.ended = True
        if self.task is not None:
            self.task.cancel()
        self.credit.fail()
        self._wake()

    def _taken(self, size: int) -> None:
        if (room := self._grants.consumed(size)) and not self.ended and self.conn.closed is None:
            self.conn.write(self.sid, WINDOW, GRANT.pack(room))

    # -- for the handler ----------------------------------------------------------------------

    async def read(self) -> Any:
        """The next request, grpc.aio.EOF after the client's end of stream."""
        msg = await self._next_request()
        return grpc.aio.EOF if msg is None else msg

    async def respond(self, message: Message) -> None:
        """Send a response once the client's window has room (and then its socket buffer)."""
        while not self.ended and self.credit.left <= 0:
            await self.credit.wait()
        if self.ended:
            raise asyncio.CancelledError()  # (the call is gone: as grpc.aio's write to a cancelled call)
        payload = message.SerializeToString()
        self.credit.left -= len(payload)
        self.conn.write(self.sid, RESPONSE, payload)
        await self.conn.drain()

    def end(self, payload: bytes = b"") -> None:
        if self.ended:
            return
        self.ended = True
        if self.conn.closed is None:
            self.conn.write(self.sid, END, payload)


async def serve(servicer: Servicer, call: RpcStream, first: Message, ctx: Context) -> None:
    """Run `call`'s method on `servicer` (the gRPC service's own handler) and END the call with its
    outcome: OK after its responses, the code it aborted with, INTERNAL for a surprise."""
    method = call.method
    handler: Callable[..., Coroutine[Any, Any, Any]] = getattr(servicer, method.name)
    try:
        if method.client_streaming:
            result = await handler(None, ctx)  # (it reads the first message first: `accept` queued it)
        else:
            result = await handler(first, ctx)
        if not method.server_streaming and result is not None:
            await call.respond(result)
        call.end()
    except grpc.aio.AbortError:
        call.end(end_payload(ctx.code() or grpc.StatusCode.UNKNOWN, ctx.details))
    except asyncio.CancelledError:
        if not call.ended and cancelled_under_us():  # (grpc.aio's, from a call to a peer that went away)
            call.end(
                end_payload(grpc.StatusCode.UNAVAILABLE, f"{method.name} was interrupted inside the broker; retry")
            )
            return
        call.ended = True  # (reset by the client, or the connection went: nobody to answer)
        raise
    except Exception as exc:
        if isinstance(exc, StreamError):  # (the connection failed under a response)
            call.ended = True
            return
        log.exception("%s on the data port failed unexpectedly", method.name)
        call.end(end_payload(grpc.StatusCode.INTERNAL, f"{method.name} failed inside the broker: {exc!r}"))
