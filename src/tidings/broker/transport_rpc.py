"""Clients' RPCs over `transport.py`'s framing: the Journal service's methods on a broker's data port,
the Target service's on a LogPlayer target's (`Service`: a HELLO, an ALPN, numbered methods).

A client connection opens with the service's HELLO (`tidings-client/2` for the Journal service; over
TLS the same ALPN, mutual as the port's replication connections are) and then multiplexes calls, one
stream each, numbered upwards by the client:

- **OPEN** (client): `!BH` (method, token length), the token (its `authorization` bearer, as gRPC's
  metadata carries it), then the call's first request message (an Append's first AppendRequest).
- **REQUEST** (client): a client stream's further requests (an Append's AppendRequests, a Deliver's
  batches); **CLOSE_SEND**: its end of stream.
- **RESPONSE** (broker): a response message (one for a unary call, any number for Read, List, Deliver).
- **END** (broker): the call's status: empty for OK, else `!B` gRPC code and the details.
- **RESET** (client): the call is cancelled (an Append then rolls back, as a cancelled gRPC call).
- **WINDOW** (either): `!I`, bytes of the call's messages its receiver consumed: room to send more.

**Flow control per call**, as HTTP/2's: each side of a call may have at most its window of message bytes
unconsumed by the other (and overdraw it by one message), and gets room back by WINDOW frames as the
other side's user consumes them; a window starts at `INITIAL_WINDOW` and opens to `CALL_WINDOW` once
consumed (`frames.Grants`). So a call whose handler or caller is slow (an append waiting for its
journal's pipeline, a Read nobody iterates) holds only its window, never the connection: a broker reads
a client's connection while it holds under CLIENT_INBOUND_HIGH unconsumed (thousands of waiting calls)
and while the client reads what it is sent, so a RESET is heard at once. A client that sends past a
window, sends requests to a call that takes one, or opens over MAX_CALLS calls at once is broken: its
connection is closed. A request over the service's `max_request` is refused RESOURCE_EXHAUSTED, as
gRPC's message limit is.

The server serves each call with the same servicer method gRPC calls (the broker's `_Servicer`, a
target's `TargetService`), through a `Context` that offers what they use of grpc.aio's ServicerContext
(`read`, `write`, `abort`, `code`, `invocation_metadata`, `peer`): one handler per RPC for both
transports, so capability checks, proxying and every status are the same. A response waits for room
in the call's window, then for the socket buffer to drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import grpc
from google.protobuf.message import Message

from tidings.broker.frames import (
    END,
    GRANT,
    MAX_FRAME,
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

OPEN_HEAD = struct.Struct("!BH")  # method, token length
MAX_CALLS = 1024  # calls one client connection may have open at once (a client waits for one to end)


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


class Service:
    """A gRPC service as the framing serves it: the HELLO (and TLS ALPN) that opens a connection for its
    calls, and its methods by number and by name."""

    def __init__(self, hello: str, *methods: Method, max_request: int) -> None:
        self.hello, self.alpn = hello.encode(), hello
        self.max_request = max_request  # bytes of one request message at most (gRPC's max receive length)
        self.methods = {m.number: m for m in methods}
        self.by_name = {m.name: m for m in methods}


JOURNAL = Service(
    "tidings-client/2",
    Method(1, "Append", pb.AppendRequest, pb.AppendResponse, client_streaming=True),
    Method(2, "Read", pb.ReadRequest, pb.ReadResponse, server_streaming=True),
    Method(3, "List", pb.ListRequest, pb.ListResponse, server_streaming=True),
    Method(4, "ListFragments", pb.FragmentsRequest, pb.FragmentsResponse),
    Method(5, "Apply", pb.ApplyRequest, pb.ApplyResponse),
    Method(6, "ListMembers", pb.MembersRequest, pb.MembersResponse),
    max_request=8 * 1024 * 1024,  # (an append's chunk is at most 4 MiB: validate.MAX_CHUNK)
)
TARGET = Service(
    "tidings-target/1",
    Method(1, "Deliver", pb.DeliverRequest, pb.DeliverResponse, client_streaming=True, server_streaming=True),
    Method(2, "GetLastAck", pb.LastAckRequest, pb.LastAckResponse),
    max_request=MAX_FRAME,  # (a batch of one WAL entry of up to 64 MiB)
)


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
        self._grants.received(size)
        if self.method.client_streaming:
            self._queue(first, size, first=True)

    def deliver(self, payload: memoryview, size: int) -> bool:
        """A request arrived (parsed here: a DecodeError closes the connection, as a replication frame's);
        false if the client had no room left to send it, or the call takes no more requests (the
        connection is then closed)."""
        if not self.method.client_streaming or not self._grants.received(size):
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

    async def requests(self) -> AsyncIterator[Message]:
        """The requests until the client's end of stream (a bidi handler's request iterator)."""
        while (msg := await self._next_request()) is not None:
            yield msg

    async def respond(self, message: Message, last: bool = False) -> None:
        """Send a response once the client's window has room (and then its socket buffer); `last`: the
        call's only or last one, sent with the call's END (OK) in one write."""
        while not self.ended and self.credit.left <= 0:
            await self.credit.wait()
        if self.ended:
            raise asyncio.CancelledError()  # (the call is gone: as grpc.aio's write to a cancelled call)
        payload = message.SerializeToString()
        self.credit.left -= len(payload)
        if last:  # (no drain: the call is over, and its END has reached the client before its task ends, so
            # its slot must be free at once; waiting in `calls` for a paused connection made a client that
            # reopened at MAX_CALLS look broken)
            self.ended = True
            self.conn.write(self.sid, RESPONSE, payload, end=b"")
            return
        self.conn.write(self.sid, RESPONSE, payload)
        if not self.conn.flowing:
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
    handler: Callable[..., Any] = getattr(servicer, method.name)
    try:
        if method.client_streaming and method.server_streaming:  # (an async generator over the requests)
            async with contextlib.aclosing(handler(call.requests(), ctx)) as responses:
                async for response in responses:
                    await call.respond(response)
        else:
            if method.client_streaming:
                result = await handler(None, ctx)  # (it reads the first message first: `accept` queued it)
            else:
                result = await handler(first, ctx)
            if not method.server_streaming and result is not None:
                await call.respond(result, last=True)  # (with its END: one write)
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
        if isinstance(exc, StreamError) and call.conn.closed is not None:  # (the connection failed under a response)
            call.ended = True
            return
        log.exception("%s on the data port failed unexpectedly", method.name)
        call.end(end_payload(grpc.StatusCode.INTERNAL, f"{method.name} failed inside the broker: {exc!r}"))
