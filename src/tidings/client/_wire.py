"""The client's end of a broker's data port (`broker/transport_rpc.py`): the Journal service's calls over
tidings' own framing instead of gRPC, one connection per broker, many calls on it.

`WireStub(channel)` offers the calls `AsyncClient` makes, shaped as grpc.aio's (`stub.Read(req,
metadata=)` iterated, `stub.List(...)`, `stub.Append(requests, metadata=, timeout=)` awaited or written
to), and fails as grpc.aio does, with a `grpc.RpcError` carrying a code and details (`WireError`), so
the client maps both transports' failures in one place (`map_grpc_error`). A connection that cannot
be made or breaks fails its calls UNAVAILABLE; a deadline ends a call DEADLINE_EXCEEDED and resets it
on the broker (an Append is rolled back, as a cancelled gRPC call's); `cancel()` resets it too.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
from collections.abc import AsyncIterable, AsyncIterator, Callable, Generator
from typing import Any, cast

import grpc
from google.protobuf.message import Message

from tidings.broker import transport_tls
from tidings.broker.frames import (
    CLOSE_SEND,
    END,
    HELLO,
    OPEN,
    PING,
    PONG,
    REQUEST,
    RESET,
    RESPONSE,
    Inbox,
    StreamError,
    end_status,
)
from tidings.broker.transport import CONNECT_TIMEOUT, _Connection, _split
from tidings.broker.transport_rpc import BY_NAME, CLIENT_ALPN, CLIENT_HELLO, OPEN_HEAD, Method
from tidings.tls import TLS

__all__ = ["WireChannel", "WireError", "WireStub"]


class WireError(grpc.RpcError):  # type: ignore[misc]  # (grpc is untyped: RpcError is Any to mypy)
    """A call on the data port failed: what grpc.aio's AioRpcError gives (`code()`, `details()`)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _ClientConnection(_Connection):
    """A connection to a broker's data port carrying this client's calls."""

    hellos = (CLIENT_HELLO,)

    def __init__(self, endpoint: str, forget: Callable[[_ClientConnection], None]) -> None:
        super().__init__(f"calls to {endpoint}")
        self.endpoint = endpoint
        self.calls: dict[int, _Call] = {}
        self._next_sid = 1
        self._forget = forget

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.write(0, HELLO, CLIENT_HELLO)

    def open(self, call: _Call, first: Message, token: str) -> int:
        sid = self._next_sid
        self._next_sid += 1
        self.calls[sid] = call
        encoded = token.encode()
        self.write(sid, OPEN, OPEN_HEAD.pack(call.method.number, len(encoded)) + encoded + first.SerializeToString())
        return sid

    def frame(self, sid: int, kind: int, payload: memoryview, size: int) -> None:
        if kind == RESPONSE:
            if (call := self.calls.get(sid)) is not None:
                call._deliver(call.method.response.FromString(payload))  # type: ignore[arg-type]  # parses any buffer
        elif kind == END and sid == 0:
            code, details = end_status(bytes(payload))
            self.close(f"the broker refused the connection: {code.name}: {details}")
        elif kind == END:
            if (call := self.calls.pop(sid, None)) is not None:
                call._end(*end_status(bytes(payload)))
        elif kind not in (PONG, HELLO):
            self.close(f"the broker sent a frame of unknown kind {kind}")

    def tick(self) -> None:
        self.write(0, PING)

    def lost(self, why: str) -> None:
        self._forget(self)
        calls, self.calls = self.calls, {}
        for call in calls.values():
            call._end(grpc.StatusCode.UNAVAILABLE, f"{self.endpoint}: {why}")


class WireChannel:
    """Calls to one broker's data port at `endpoint`, over one connection dialed on first use (again
    after it broke), with `tls` when the client has it."""

    def __init__(self, endpoint: str, tls: TLS | None = None) -> None:
        self.endpoint = endpoint
        self._tls: ssl.SSLContext | None = transport_tls.contexts(tls, [CLIENT_ALPN])[1] if tls is not None else None
        self._conn: _ClientConnection | None = None
        self._dialing: asyncio.Future[_ClientConnection] | None = None

    async def connection(self) -> _ClientConnection:
        if self._conn is not None and self._conn.closed is None:
            return self._conn
        if self._dialing is None or self._dialing.done():
            self._dialing = asyncio.ensure_future(self._dial())
        return await asyncio.shield(self._dialing)

    async def _dial(self) -> _ClientConnection:
        def made() -> _ClientConnection:
            return _ClientConnection(self.endpoint, self._forget)

        try:
            host, port = _split(self.endpoint)
            if self._tls is not None:
                conn = await transport_tls.dial(host, port, self._tls, made, CONNECT_TIMEOUT, alpn=(CLIENT_ALPN,))
            else:
                async with asyncio.timeout(CONNECT_TIMEOUT):
                    _, conn = await asyncio.get_running_loop().create_connection(made, host, port)
        except TimeoutError:
            why = f"{self.endpoint}: not reachable within {CONNECT_TIMEOUT:g}s"
            raise WireError(grpc.StatusCode.UNAVAILABLE, why) from None
        except (OSError, ValueError) as exc:
            raise WireError(grpc.StatusCode.UNAVAILABLE, f"{self.endpoint}: {exc or type(exc).__name__}") from None
        self._conn = cast(_ClientConnection, conn)
        return self._conn

    def _forget(self, conn: _ClientConnection) -> None:
        if self._conn is conn:
            self._conn = None

    async def close(self) -> None:
        if self._dialing is not None:
            self._dialing.cancel()
        if self._conn is not None:
            self._conn.close("the client closed")


def _token(metadata: Any) -> str:
    for key, value in metadata or ():
        if key.lower() == "authorization":
            return str(value).removeprefix("Bearer ")
    return ""


class _Call(Inbox):
    """One call: opened at its first request, its responses as they come, its end status."""

    def __init__(self, channel: WireChannel, method: Method, metadata: Any, timeout: float | None) -> None:
        self.channel, self.method = channel, method
        self._token = _token(metadata)
        self._deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        self._conn: _ClientConnection | None = None
        self._sid = 0
        self._responses: collections.deque[Message] = collections.deque()
        self._status: tuple[grpc.StatusCode, str] | None = None
        self._cancelled = False

    # -- from the connection ------------------------------------------------------------------

    def _deliver(self, msg: Message) -> None:
        self._responses.append(msg)
        self._wake()

    def _end(self, code: grpc.StatusCode, details: str) -> None:
        if self._status is None:
            self._status = (code, details)
        self._wake()

    # -- for the caller -----------------------------------------------------------------------

    async def _open(self, first: Message) -> None:
        """Dial (or reuse) the connection and send OPEN. A failure ends the call with it (UNAVAILABLE),
        so whoever awaits the call next hears it instead of waiting for an answer never asked for."""
        if self._cancelled:
            raise asyncio.CancelledError()
        try:
            conn = self._conn = await self.channel.connection()
            self._sid = conn.open(self, first, self._token)
        except WireError as exc:
            self._end(exc.code(), exc.details())
            raise
        except StreamError as exc:  # (the connection closed between the dial and the OPEN)
            self._end(grpc.StatusCode.UNAVAILABLE, f"{self.channel.endpoint}: {exc}")
            raise WireError(grpc.StatusCode.UNAVAILABLE, f"{self.channel.endpoint}: {exc}") from None

    def _send(self, kind: int, msg: Message | None = None) -> None:
        if self._status is not None:
            raise asyncio.InvalidStateError("the call has ended")  # (as grpc.aio's write after the end)
        assert self._conn is not None
        try:
            self._conn.write(self._sid, kind, msg.SerializeToString() if msg is not None else b"")
        except StreamError as exc:  # (the connection broke: lost() ends the call UNAVAILABLE too)
            self._end(grpc.StatusCode.UNAVAILABLE, f"{self.channel.endpoint}: {exc}")
            raise asyncio.InvalidStateError("the call has ended") from None

    async def _next(self) -> Message | None:
        """The next response, None at a clean end; WireError at a failed end or the deadline."""
        while not self._responses:
            if self._status is not None:
                code, details = self._status
                if code == grpc.StatusCode.OK:
                    return None
                raise WireError(code, details)
            if self._cancelled:
                raise asyncio.CancelledError()
            try:
                async with asyncio.timeout_at(self._deadline):
                    await self._delivery()
            except TimeoutError:
                self.cancel()
                raise WireError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
            except asyncio.CancelledError:
                self.cancel()  # (as grpc.aio: a caller that stops waiting ends the call on the broker too)
                raise
        return self._responses.popleft()

    def cancel(self) -> bool:
        """Reset the call on the broker (an Append rolls back); false if it had already ended."""
        if self._status is not None or self._cancelled:
            return False
        self._cancelled = True
        if self._conn is not None and self._sid and self._conn.closed is None:
            self._conn.write(self._sid, RESET)
            self._conn.calls.pop(self._sid, None)
        self._wake()
        return True


class _UnaryCall(_Call):
    """A call with one response (Append, ListFragments, Apply, ListMembers): awaited."""

    def __init__(self, channel: WireChannel, method: Method, request: Message | None, metadata: Any,
                 timeout: float | None, requests: Any = None) -> None:  # fmt: skip
        super().__init__(channel, method, metadata, timeout)
        self._request, self._requests = request, requests
        self._started = False

    async def _run(self) -> Message:
        if not self._started:
            self._started = True
            if self._requests is not None:
                await self._stream(self._requests)
            elif self._request is not None:
                await self._open(self._request)
                if self.method.client_streaming:
                    self._send(CLOSE_SEND)
        resp = await self._next()
        if resp is None:
            raise WireError(
                grpc.StatusCode.INTERNAL, f"{self.method.name}: the broker ended the call without an answer"
            )
        return resp

    async def _stream(self, requests: AsyncIterable[Message]) -> None:
        opened = False
        async for msg in requests:
            if self._status is not None:
                return  # (answered early: its answer follows)
            if not opened:
                await self._open(msg)
                opened = True
            else:
                self._send(REQUEST, msg)
                await self._drain()
        if opened and self._status is None:
            self._send(CLOSE_SEND)

    async def _drain(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):  # (a broken connection ends the call: _next says how)
                await self._conn.drain()

    def __await__(self) -> Generator[Any, None, Message]:
        return self._run().__await__()

    async def write(self, msg: Message) -> None:
        """Send a request of a client stream (the first opens the call)."""
        self._started = True
        if self._sid == 0:
            await self._open(msg)
        else:
            self._send(REQUEST, msg)
            await self._drain()

    async def done_writing(self) -> None:
        if self._sid and self._status is None:
            self._send(CLOSE_SEND)


class _StreamCall(_Call):
    """A call with a stream of responses (Read, List): iterated."""

    def __init__(self, channel: WireChannel, method: Method, request: Message, metadata: Any,
                 timeout: float | None) -> None:  # fmt: skip
        super().__init__(channel, method, metadata, timeout)
        self._request = request

    async def _responses_of(self) -> AsyncIterator[Message]:
        try:
            await self._open(self._request)
            while (resp := await self._next()) is not None:
                yield resp
        finally:
            self.cancel()  # (an iteration left early, a List watch closed: the broker's side ends too)

    def __aiter__(self) -> AsyncIterator[Message]:
        return self._responses_of()


class WireStub:
    """The Journal service's calls on a broker's data port, called as a generated gRPC stub's are
    (`stub.Append(...)`, `stub.Read(...)`: any method of transport_rpc.METHODS)."""

    def __init__(self, channel: WireChannel) -> None:
        self.channel = channel

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = BY_NAME.get(name)
        if method is None:
            raise AttributeError(f"the data port has no method {name!r}")

        def call(request: Any = None, *, metadata: Any = None, timeout: float | None = None) -> _Call:
            if method.server_streaming:
                return _StreamCall(self.channel, method, request, metadata, timeout)
            if method.client_streaming and request is not None and not isinstance(request, Message):
                return _UnaryCall(self.channel, method, None, metadata, timeout, requests=request)
            return _UnaryCall(self.channel, method, request, metadata, timeout)

        return call
