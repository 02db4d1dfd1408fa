"""The client's end of a broker's data port (`broker/transport_rpc.py`): the Journal service's calls over
tidings' own framing instead of gRPC, one connection per broker, many calls on it.

`WireStub(channel)` offers the calls `AsyncClient` makes, shaped as grpc.aio's (`stub.Read(req,
metadata=)` iterated, `stub.List(...)`, `stub.Append(requests, metadata=, timeout=)` awaited or written
to), and fails as grpc.aio does, with a `grpc.RpcError` carrying a code and details (`WireError`), so
the client maps both transports' failures in one place (`map_grpc_error`). A connection that cannot
be made or breaks fails its calls UNAVAILABLE; a deadline ends a call DEADLINE_EXCEEDED and resets it
on the broker (an Append is rolled back, as a cancelled gRPC call's); `cancel()` resets it too. A
call sends while the broker's window for it has room and grants the broker room as its caller takes
responses (`transport_rpc.py`: flow control per call), so an unread Read buffers at most its window here.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
from collections.abc import AsyncIterable, AsyncIterator, Callable, Coroutine, Generator
from typing import Any, TypeVar, cast

import grpc
from google.protobuf.message import Message

from tidings.broker import transport_tls
from tidings.broker.frames import (
    CLOSE_SEND,
    END,
    GRANT,
    HELLO,
    OPEN,
    PING,
    PONG,
    REQUEST,
    RESET,
    RESPONSE,
    WINDOW,
    Credit,
    Grants,
    Inbox,
    StreamError,
    end_status,
)
from tidings.broker.transport import CONNECT_TIMEOUT, _Connection, _split
from tidings.broker.transport_rpc import JOURNAL, MAX_CALLS, OPEN_HEAD, Method, Service
from tidings.tls import TLS

__all__ = ["WireCall", "WireChannel", "WireError", "WireStub"]

T = TypeVar("T")


class WireError(grpc.RpcError):  # type: ignore[misc]  # (grpc is untyped: RpcError is Any to mypy)
    """A call on the data port failed: what grpc.aio's AioRpcError gives (`code()`, `details()`);
    `data_port`: the port, when the connection failed under the call (not an answer of the broker's)."""

    def __init__(self, code: grpc.StatusCode, details: str, data_port: str = "") -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details
        self.data_port = data_port

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


LAST_SID = 0xFFFFFFFF  # a frame's stream id is 32 bits: a connection that used them all is replaced


class _ClientConnection(_Connection):
    """A connection to a broker's data port carrying this client's calls (numbered upwards: after the
    last number, new calls go on a new connection and this one closes when its calls are over)."""

    def __init__(
        self, endpoint: str, member: str, forget: Callable[[_ClientConnection], None], service: Service = JOURNAL
    ) -> None:
        super().__init__(f"calls to {endpoint}")
        self.endpoint = endpoint
        self.member = member
        self.hellos = (service.hello,)
        self.calls: dict[int, _Call] = {}
        self._slots: collections.deque[asyncio.Future[None]] = collections.deque()  # calls waiting for one
        self._next_sid = 1
        self._forget = forget

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._loop.call_later(CONNECT_TIMEOUT, self._check_hello)
        hello = self.hellos[0]
        self.write(0, HELLO, hello + b" " + self.member.encode() if self.member else hello)

    def open(self, call: _Call, first: Message, token: str) -> int:
        """Send `call`'s OPEN (its first message spends its window); its stream id."""
        sid = self._next_sid
        self._next_sid += 1
        if sid == LAST_SID:
            self._forget(self)  # (the channel dials another for the next call)
        self.calls[sid] = call
        encoded = token.encode()
        payload = OPEN_HEAD.pack(call.method.number, len(encoded)) + encoded + first.SerializeToString()
        self.write(sid, OPEN, payload)
        call._credit.left -= len(payload)
        return sid

    def frame(self, sid: int, kind: int, payload: memoryview, size: int) -> None:
        if kind == RESPONSE:
            if (call := self.calls.get(sid)) is not None:
                call._deliver(call.method.response.FromString(payload), size)  # type: ignore[arg-type]  # parses any buffer
        elif kind == WINDOW:
            if len(payload) != GRANT.size:
                self.close(f"the broker sent a WINDOW of {len(payload)} bytes")
            elif (call := self.calls.get(sid)) is not None:
                call._credit.grant(GRANT.unpack(payload)[0])
        elif kind == END and sid == 0:
            code, details = end_status(bytes(payload))
            self.close(f"the broker refused the connection: {code.name}: {details}")
        elif kind == END:
            if (call := self.calls.get(sid)) is not None:
                self.over(sid)
                call._end(*end_status(bytes(payload)))
        elif kind not in (PONG, HELLO):
            self.close(f"the broker sent a frame of unknown kind {kind}")

    def _check_hello(self) -> None:
        if not self._hello:
            self.close(f"no HELLO within {CONNECT_TIMEOUT:g}s of connecting: not a tidings data port?")

    def answered(self) -> bool:
        """The other side said HELLO (it is a tidings data port serving these calls)."""
        return self._hello

    def over(self, sid: int) -> None:
        """Call `sid` ended (answered or reset)."""
        self.calls.pop(sid, None)
        self._free_slot()
        if not self.calls and self._next_sid > LAST_SID:
            self.close("its stream ids are spent", flush=True)

    async def slot_freed(self) -> None:
        """Until one of MAX_CALLS calls ends (or the connection does)."""
        fut = self._loop.create_future()
        self._slots.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._free_slot()  # (woken, then cancelled before taking the slot: the next waiter takes it)
            raise

    def _free_slot(self) -> None:
        while self._slots:
            if not (fut := self._slots.popleft()).done():
                fut.set_result(None)
                return

    def tick(self) -> None:
        self.write(0, PING)

    def lost(self, why: str) -> None:
        self._forget(self)
        calls, self.calls = self.calls, {}
        for call in calls.values():
            call._end(grpc.StatusCode.UNAVAILABLE, f"{self.endpoint}: {why}", self.endpoint)
        for fut in self._slots:
            if not fut.done():
                fut.set_result(None)


class WireChannel:
    """Calls to one broker's data port at `endpoint`, over one connection dialed on first use (again
    after it broke), with `tls` when the client has it. `member` ("zone/suffix"): the broker meant; another
    found there (a stale endpoint) refuses the connection. `service`: whose calls (a broker's Journal, a
    LogPlayer target's Target)."""

    def __init__(self, endpoint: str, tls: TLS | None = None, member: str = "", service: Service = JOURNAL) -> None:
        self.endpoint = endpoint
        self.member = member
        self.service = service
        self._tls: ssl.SSLContext | None = transport_tls.contexts(tls, [service.alpn])[1] if tls is not None else None
        self._conn: _ClientConnection | None = None
        self._dialing: asyncio.Future[_ClientConnection] | None = None
        self._closed = False

    def ready(self) -> _ClientConnection | None:
        """The connection, if it is up and has room for another call (else `connection()` waits)."""
        conn = self._conn
        if conn is None or conn.closed is not None or self._closed or len(conn.calls) >= MAX_CALLS:
            return None
        return conn

    async def connection(self) -> _ClientConnection:
        if self._closed:
            raise WireError(grpc.StatusCode.UNAVAILABLE, f"{self.endpoint}: the client was closed")
        if self._conn is not None and self._conn.closed is None:
            return self._conn
        if self._dialing is None or self._dialing.done():
            self._dialing = asyncio.ensure_future(self._dial())
        dialing = self._dialing
        try:
            return await asyncio.shield(dialing)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if dialing.cancelled() and self._closed and not (task is not None and task.cancelling()):
                raise WireError(grpc.StatusCode.UNAVAILABLE, f"{self.endpoint}: the client was closed") from None
            raise  # (our caller was cancelled)

    async def _dial(self) -> _ClientConnection:
        def made() -> _ClientConnection:
            return _ClientConnection(self.endpoint, self.member, self._forget, self.service)

        try:
            host, port = _split(self.endpoint)
            if self._tls is not None:
                alpn = (self.service.alpn,)
                conn = await transport_tls.dial(host, port, self._tls, made, CONNECT_TIMEOUT, alpn=alpn)
            else:
                async with asyncio.timeout(CONNECT_TIMEOUT):
                    _, conn = await asyncio.get_running_loop().create_connection(made, host, port)
        except TimeoutError:
            why = f"{self.endpoint}: not reachable within {CONNECT_TIMEOUT:g}s"
            raise WireError(grpc.StatusCode.UNAVAILABLE, why, self.endpoint) from None
        except (OSError, ValueError) as exc:
            why = f"{self.endpoint}: {exc or type(exc).__name__}"
            raise WireError(grpc.StatusCode.UNAVAILABLE, why, self.endpoint) from None
        self._conn = cast(_ClientConnection, conn)
        return self._conn

    def _forget(self, conn: _ClientConnection) -> None:
        if self._conn is conn:
            self._conn = None

    async def close(self) -> None:
        self.shut()

    def shut(self) -> None:
        """Close now: the connection's calls and any waiting for its dial fail UNAVAILABLE."""
        self._closed = True
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
        self._responses: collections.deque[tuple[Message, int]] = collections.deque()
        self._status: tuple[grpc.StatusCode, str, str] | None = None  # code, details, the failed data port
        self._cancelled = False
        self._credit = Credit()  # room in the broker's window for our requests
        self._grants = Grants()  # what our caller took of the responses, to give back

    # -- from the connection ------------------------------------------------------------------

    def _deliver(self, msg: Message, size: int) -> None:
        self._responses.append((msg, size))
        self._wake()

    def _end(self, code: grpc.StatusCode, details: str, data_port: str = "") -> None:
        if self._status is None:
            self._status = (code, details, data_port)
        self._credit.fail()
        self._wake()

    # -- for the caller -----------------------------------------------------------------------

    async def _open(self, first: Message) -> None:
        """Dial (or reuse) the connection and send OPEN. A failure ends the call with it (UNAVAILABLE),
        so whoever awaits the call next hears it instead of waiting for an answer never asked for."""
        if self._cancelled:
            raise asyncio.CancelledError()
        try:
            conn = self.channel.ready()  # (the usual case: no wait, no timer)
            if conn is None:
                conn = await self._waiting(self._connection())
            if self._cancelled:  # (cancelled, or its deadline passed, while dialing: never opened)
                raise asyncio.CancelledError()
            if self._status is not None:
                raise WireError(*self._status)
            self._conn = conn
            self._sid = conn.open(self, first, self._token)
        except WireError as exc:
            self._end(exc.code(), exc.details(), exc.data_port)
            raise
        except StreamError as exc:  # (the connection closed between the dial and the OPEN)
            why = f"{self.channel.endpoint}: {exc}"
            self._end(grpc.StatusCode.UNAVAILABLE, why, self.channel.endpoint)
            raise WireError(grpc.StatusCode.UNAVAILABLE, why, self.channel.endpoint) from None

    async def _connection(self) -> _ClientConnection:
        """The channel's connection, dialed if need be, once it has room for another call."""
        while True:
            conn = await self.channel.connection()
            if len(conn.calls) < MAX_CALLS:
                return conn
            await conn.slot_freed()  # (as many calls as the broker serves on one connection: wait for one to end)

    def _send(self, kind: int, payload: bytes = b"") -> None:
        if self._status is not None:
            raise asyncio.InvalidStateError("the call has ended")  # (as grpc.aio's write after the end)
        assert self._conn is not None
        try:
            self._conn.write(self._sid, kind, payload)
        except StreamError as exc:  # (the connection broke: lost() ends the call UNAVAILABLE too)
            self._end(grpc.StatusCode.UNAVAILABLE, f"{self.channel.endpoint}: {exc}", self.channel.endpoint)
            raise asyncio.InvalidStateError("the call has ended") from None

    def _expired(self) -> bool:
        """False before the deadline; after it, the call is reset and DEADLINE_EXCEEDED raised."""
        if self._deadline is None or asyncio.get_running_loop().time() < self._deadline:
            return False
        raise self._deadline_passed()

    def _deadline_passed(self) -> WireError:
        """Reset the call and end it DEADLINE_EXCEEDED (whoever awaits it hears that, not a cancellation)."""
        self.cancel()
        if self._status is None:
            self._status = (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", "")
        return WireError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    async def _send_request(self, msg: Message) -> None:
        """Send a further request once the broker's window has room, then wait for the socket buffer (both
        under the deadline). An ended call sends nothing: its answer follows."""
        while self._credit.left <= 0 and self._status is None and not self._cancelled:
            await self._waiting(self._credit.wait())
        if self._status is not None:
            return
        if self._cancelled:
            raise asyncio.CancelledError()
        self._expired()
        payload = msg.SerializeToString()
        self._credit.left -= len(payload)
        self._send(REQUEST, payload)
        if self._conn is not None and not self._conn.flowing:  # (no coroutine and timer per request otherwise)
            with contextlib.suppress(StreamError):  # (a broken connection ends the call: _next says how)
                await self._waiting(self._conn.drain())

    async def _waiting(self, step: Coroutine[Any, Any, T]) -> T:
        """Await `step` until the call's deadline (then DEADLINE_EXCEEDED); a deadline or a caller that
        stops waiting resets the call on the broker, as grpc.aio's do."""
        try:
            async with asyncio.timeout_at(self._deadline):
                return await step
        except TimeoutError:
            raise self._deadline_passed() from None
        except asyncio.CancelledError:
            self.cancel()
            raise

    async def _next(self) -> Message | None:
        """The next response, None at a clean end; WireError at a failed end or the deadline."""
        while not self._responses:
            if self._status is not None:
                code, details, data_port = self._status
                if code == grpc.StatusCode.OK:
                    return None
                raise WireError(code, details, data_port)
            if self._cancelled:
                raise asyncio.CancelledError()
            await self._waiting(self._delivery())
        msg, size = self._responses.popleft()
        if (room := self._grants.consumed(size)) and self._status is None and self._conn is not None:
            with contextlib.suppress(StreamError):  # (a broken connection ends the call: the next _next says so)
                self._conn.write(self._sid, WINDOW, GRANT.pack(room))
        return msg

    async def write(self, msg: Message) -> None:
        """Send a request of a client stream (the first opens the call); InvalidStateError once it ended,
        as grpc.aio's write after the end."""
        if self._sid == 0:
            await self._open(msg)
            return
        if self._status is not None:
            raise asyncio.InvalidStateError("the call has ended")
        await self._send_request(msg)

    async def done_writing(self) -> None:
        if self._sid and self._status is None:
            self._send(CLOSE_SEND)

    def reached(self) -> bool:
        """The call's connection reached a tidings data port (its HELLO was heard)."""
        return self._conn is not None and self._conn.answered()

    def cancel(self) -> bool:
        """Reset the call on the broker (an Append rolls back); false if it had already ended."""
        if self._status is not None or self._cancelled:
            return False
        self._cancelled = True
        if self._conn is not None and self._sid and self._conn.closed is None:
            self._conn.write(self._sid, RESET)
            self._conn.over(self._sid)
        self._credit.fail()
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
                return await self._streamed(self._requests)
            if self._request is not None:
                await self._open(self._request)
                if self.method.client_streaming and self._status is None and not self._expired():
                    self._send(CLOSE_SEND)
        return await self._answer()

    async def _streamed(self, requests: AsyncIterable[Message]) -> Message:
        """Send `requests` from a task of their own while waiting for the answer, as grpc.aio does: the
        deadline and an early answer (a refusal) end the call even while the iterable has nothing to
        give; an iterable that raises cancels the call and its exception is raised here."""
        sender = asyncio.ensure_future(self._stream(requests))
        answer = asyncio.ensure_future(self._answer())
        try:
            await asyncio.wait([sender, answer], return_when=asyncio.FIRST_COMPLETED)
            if sender.done() and not sender.cancelled() and (exc := sender.exception()) is not None:
                if not isinstance(exc, WireError | asyncio.InvalidStateError):  # (the iterable's own failure)
                    self.cancel()
                    raise exc
            return await answer
        finally:
            for task in (sender, answer):
                task.cancel()
            await asyncio.gather(sender, answer, return_exceptions=True)

    async def _answer(self) -> Message:
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
                await self._send_request(msg)
        if opened and self._status is None and not self._expired():
            self._send(CLOSE_SEND)

    def __await__(self) -> Generator[Any, None, Message]:
        return self._run().__await__()

    async def write(self, msg: Message) -> None:
        self._started = True
        await super().write(msg)


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


class _BidiCall(_Call):
    """A call streaming both ways (Deliver), used as grpc.aio's StreamStreamCall: `write`, `read` (EOF at
    the end), `done_writing`, `code`, `details`, `cancel`."""

    def __init__(self, channel: WireChannel, method: Method, metadata: Any, timeout: float | None) -> None:
        super().__init__(channel, method, metadata, timeout)

    async def read(self) -> Any:
        """The next response, grpc.aio.EOF after a clean end; WireError after a failed one."""
        msg = await self._next()
        return grpc.aio.EOF if msg is None else msg

    async def code(self) -> grpc.StatusCode:
        """How the call ended (waiting for its end; CANCELLED once cancelled here)."""
        while self._status is None:
            if self._cancelled:
                return grpc.StatusCode.CANCELLED
            await self._waiting(self._delivery())
        return self._status[0]

    async def details(self) -> str:
        if await self.code() == grpc.StatusCode.CANCELLED and self._status is None:
            return "Locally cancelled"
        assert self._status is not None
        return self._status[1]


WireCall = _Call  # (what WireStub's methods return)


class WireStub:
    """A service's calls on a data port, called as a generated gRPC stub's are (`stub.Append(...)`,
    `stub.Read(...)`, `stub.Deliver(...)`: any method of the channel's `transport_rpc.Service`)."""

    def __init__(self, channel: WireChannel) -> None:
        self.channel = channel

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = self.channel.service.by_name.get(name)
        if method is None:
            raise AttributeError(f"the data port has no method {name!r}")

        def call(request: Any = None, *, metadata: Any = None, timeout: float | None = None) -> _Call:
            if method.server_streaming and method.client_streaming:
                return _BidiCall(self.channel, method, metadata, timeout)
            if method.server_streaming:
                return _StreamCall(self.channel, method, request, metadata, timeout)
            if method.client_streaming and request is not None and not isinstance(request, Message):
                return _UnaryCall(self.channel, method, None, metadata, timeout, requests=request)
            return _UnaryCall(self.channel, method, request, metadata, timeout)

        return call
