"""Replication between brokers: framing, connections, and the send / receive interface over them.

A primary's `Pipeline` holds one `ReplicaStream` per peer; a peer serves each stream through a
`PeerStream`. Nothing above this module knows what carries the messages. Clients speak gRPC;
brokers replicate over this module's own framed TCP streams, because grpc.aio hands every message
between its poller thread and the event loop: a 1 KiB write replicated to two peers costs the
sender 211 µs of CPU and 330 µs of latency over grpc.aio, 28 µs and 43 µs here
(`bench/transport.py`, 2-core VM).

**Frames.** ``!IIB`` (payload length, stream id, kind) then the payload: a serialized
`ReplicateRequest` (REQUEST) or `ReplicateResponse` (RESPONSE), the same messages gRPC carried.
A payload over `MAX_FRAME` bytes, an unknown kind, a message that does not parse, or a
connection whose first frame is not our HELLO ends the connection (garbage on the port is
logged in one line; the server goes on serving).

**Connections.** Streams are multiplexed: a broker keeps one connection to each peer it is
primary for (`Dialer`), and accepts one from each broker primary towards it (`ReplicationServer`),
however many journals they share. A pipeline that sits idle costs a dict entry and, on the peer,
one suspended handler coroutine; never a socket, a keep-alive timer or a reading task of its own.
The primary numbers its streams upwards; a REQUEST on a number above any seen opens a stream,
frames for a stream already finished are dropped.

**Failure, explicit.** Every way a stream can fail (connection refused or lost, the peer's END
with an error, a RESET, a half-open connection, a frame over the limit) reaches the stream's
user as `StreamError`. The primary pings every `KEEPALIVE_INTERVAL`; either side that hears
nothing for `KEEPALIVE_TIMEOUT` drops the connection (a frozen peer, a half-open socket).

**Bounded memory.** A send writes the whole frame into the socket's buffer synchronously, so a
cancellation can never tear a frame or split a request across peers; `drain()` then waits
while the buffer is over its high-water mark (a peer that stops reading stops its primary).
A peer's connection stops reading while its streams hold over `INBOUND_HIGH` unconsumed
bytes. This stalls every stream of that connection, which is what a slow peer means; a handler
still waiting for its spool holds only its sync proposals, because a primary sends no content
before every peer answered its sync proposal (`append_fsm.py`).

**HELLO.** The primary's HELLO names the broker it means to reach ("zone/suffix"); another broker
(a stale endpoint: the peer moved, someone else took its port) answers HELLO then refuses with its
reason (an END on stream 0), so a stream never lands on the wrong replica. A broker with keys
(--auth-keys) also requires a token with the REPLICATE capability in the HELLO (brokers sign their
own, scoped to all journals: Gazette scopes each pipeline to its journal, we authorize the
connection; it lives as long as the keys it was verified with, which change only by a restart) and
refuses any other with UNAUTHENTICATED or PERMISSION_DENIED before a stream is served. With TLS (a broker's
--tls-*), connections are TLS sockets driven by `transport_tls.py`, mutual when a CA is given.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import socket
from collections.abc import Callable, Coroutine
from typing import Any, Protocol, cast

import grpc
from google.protobuf.message import DecodeError

from tidings.auth import AuthError, Authorizer, Verifier
from tidings.broker import transport_tls
from tidings.broker.frames import (
    CLOSE_SEND,
    END,
    GRANT,
    HEADER,
    HELLO,
    MAX_FRAME,
    OPEN,
    PING,
    PONG,
    REQUEST,
    RESET,
    RESPONSE,
    WINDOW,
    Inbound,
    Inbox,
    StreamError,
    end_payload,
    end_status,
)
from tidings.broker.transport_rpc import JOURNAL, MAX_CALLS, OPEN_HEAD, Context, RpcStream, Service, Servicer
from tidings.broker.transport_rpc import serve as serve_call
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.claims import Capability, Claims
from tidings.tls import TLS

log = logging.getLogger(__name__)

HELLO_PAYLOAD = b"tidings-replicate/1"
HELLO_MAX = 8 * 1024 + 256  # a HELLO's payload at most: the version, the broker meant, a token (at most 8 KiB)
KEEPALIVE_INTERVAL = 2.0  # seconds between the primary's pings
KEEPALIVE_TIMEOUT = 10.0  # seconds of silence after which a connection is dropped
IDLE_CLOSE = 60.0  # seconds a primary keeps a connection without streams
INBOUND_HIGH = 16 * 1024 * 1024  # unconsumed bytes at which a peer's connection stops reading
INBOUND_LOW = 4 * 1024 * 1024
CLIENT_INBOUND_HIGH = 256 * 1024 * 1024  # a client's connection: far above what its calls' windows hold
CLIENT_STALL = 60.0  # seconds a client may leave what it was sent unread before its connection is dropped
WRITE_HIGH = 4 * 1024 * 1024  # socket buffer bytes at which drain() waits
CONNECT_TIMEOUT = 5.0

_REPLICATE = int(Capability.REPLICATE)


class ReplicaStream(Protocol):
    """The primary's end of one peer's replication stream (sends by the pipeline's send-side owner,
    receives by its receive loop)."""

    endpoint: str

    def send(self, message: bytes) -> None:
        """Write one serialized ReplicateRequest (whole, at once); StreamError if the stream is broken."""

    async def drain(self) -> None:
        """Wait while the connection's send buffer is over its high-water mark; StreamError if broken."""

    async def recv(self) -> pb.ReplicateResponse | None:
        """The next response, or None when the peer ended the stream cleanly; StreamError on failure."""

    def close_send(self) -> None:
        """No more requests: the peer rolls back what is uncommitted and ends its side."""

    def abort(self) -> None:
        """Tear the stream down now (idempotent)."""


class PeerStream(Protocol):
    """A peer's end of a primary's replication stream."""

    @property
    def claims(self) -> Claims | None:
        """What the connection's HELLO token allows (None: this broker has no keys)."""

    async def recv(self) -> pb.ReplicateRequest | None:
        """The next request, or None at the primary's end of stream; StreamError if it was torn down."""

    async def send(self, resp: pb.ReplicateResponse) -> None: ...

    async def fail(self, code: grpc.StatusCode, message: str) -> None:
        """End the stream with an error status."""


class FailedStream:
    """A stream that could not be opened (e.g. a peer without an endpoint): every use fails."""

    def __init__(self, endpoint: str, reason: str) -> None:
        self.endpoint = endpoint
        self.reason = reason

    def send(self, message: bytes) -> None:
        raise StreamError(self.reason)

    async def drain(self) -> None:
        raise StreamError(self.reason)

    async def recv(self) -> pb.ReplicateResponse | None:
        raise StreamError(self.reason)

    def close_send(self) -> None:
        return None

    def abort(self) -> None:
        return None


def _split(endpoint: str) -> tuple[str, int]:
    """HOST:PORT -> (host, port); ValueError naming what is wrong."""
    host, _, port = endpoint.rpartition(":")
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"{port!r} is not a port number (want HOST:PORT)")
    return host.strip("[]"), int(port)


def _end_error(payload: bytes) -> str:
    code, message = end_status(payload)
    return f"{code.name}: {message}"


class _Connection(asyncio.Protocol):
    """One TCP connection carrying many streams: frame parsing, writes, flow control, keep-alive."""

    hellos: tuple[bytes, ...] = (HELLO_PAYLOAD,)  # what the other side's HELLO may say

    def __init__(self, name: str) -> None:
        self.name = name
        self.transport: asyncio.Transport | None = None
        self.closed: str | None = None  # why, once closed
        self._buf = bytearray()
        self._hello = False  # the other side's HELLO was seen
        self._paused = False
        self._drainers: list[asyncio.Future[None]] = []
        self._loop = asyncio.get_running_loop()
        self._last_heard = self._loop.time()
        self._timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = tcp = cast(asyncio.Transport, transport)  # uvloop's are no asyncio.Transport subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        tcp.set_write_buffer_limits(high=WRITE_HIGH)
        self._last_heard = self._loop.time()
        self._timer = self._loop.call_later(KEEPALIVE_INTERVAL, self._tick)

    def data_received(self, data: bytes) -> None:
        self._last_heard = self._loop.time()
        buf = self._buf
        buf += data
        pos, size = 0, len(buf)
        while size - pos >= HEADER.size and self.closed is None:
            length, sid, kind = HEADER.unpack_from(buf, pos)
            if not self._hello and (kind != HELLO or length > HELLO_MAX):
                self.close("it did not open with a tidings HELLO (another service's port?)")
                return
            if length > MAX_FRAME:
                self.close(f"a frame of {length} bytes is over the limit of {MAX_FRAME}")
                return
            end = pos + HEADER.size + length
            if end > size:
                break
            with memoryview(buf) as view:
                payload = view[pos + HEADER.size : end]
                try:
                    if not self._hello:
                        hello = bytes(payload)
                        said = next((p for p in self.hellos if hello == p or hello.startswith(p + b" ")), None)
                        if said is None:
                            self.close(f"its HELLO {hello!r} is not {b' or '.join(self.hellos)!r}")
                            return
                        self._hello = True
                        self.hello(said, hello[len(said) + 1 :].decode(errors="replace"))
                    else:
                        self.frame(sid, kind, payload, length)
                except DecodeError as exc:
                    self.close(f"a frame of stream {sid} does not parse ({exc})")
                finally:
                    payload.release()
            pos = end
        if self.closed is None:
            del buf[:pos]

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake_drainers()

    def connection_lost(self, exc: Exception | None) -> None:
        self.close(f"connection lost ({exc})" if exc else "connection closed")

    # -- for the streams -------------------------------------------------------------------

    def write(self, sid: int, kind: int, payload: bytes = b"", end: bytes | None = None) -> None:
        """Write one frame now (whole: no await between its parts); with `end`, the stream's END frame (that
        payload) in the same write: a unary answer then costs one system call, one TLS record and one wake-up
        of its reader, not two. Coalescing the small frames of a loop iteration into one system call was
        tried and measured no faster (bench/README.md)."""
        if self.closed is not None:
            raise StreamError(f"{self.name}: {self.closed}")
        if self.transport is None:
            raise StreamError(f"{self.name}: not connected")
        parts = [HEADER.pack(len(payload), sid, kind), payload]
        if end is not None:
            parts.append(HEADER.pack(len(end), sid, END) + end)
        if len(payload) < 65536:
            self.transport.write(b"".join(parts))
        else:  # large content: no copy into a joined buffer
            self.transport.writelines(parts)

    @property
    def flowing(self) -> bool:
        """Open and under its send buffer's high-water mark: `drain` would return at once (a caller may skip it)."""
        return not self._paused and self.closed is None

    async def drain(self) -> None:
        while self._paused and self.closed is None:
            fut = self._loop.create_future()
            self._drainers.append(fut)
            await fut
        if self.closed is not None:
            raise StreamError(f"{self.name}: {self.closed}")

    def refuse(self, why: str, code: grpc.StatusCode = grpc.StatusCode.FAILED_PRECONDITION) -> None:
        """Tell the other side why (an END on stream 0), then close once that is sent."""
        if self.closed is None and self.transport is not None:
            self.write(0, END, end_payload(code, why))
        self.close(why, flush=True)

    def close(self, why: str, flush: bool = False) -> None:
        """Close the connection and fail its streams (idempotent)."""
        if self.closed is not None:
            return
        self.closed = why
        self._buf = bytearray()
        if self._timer is not None:
            self._timer.cancel()
        if self.transport is not None:
            self.transport.close() if flush else self.transport.abort()
        self._wake_drainers()
        self.lost(why)

    def _wake_drainers(self) -> None:
        drainers, self._drainers = self._drainers, []
        for fut in drainers:
            if not fut.done():
                fut.set_result(None)

    def _tick(self) -> None:
        silent = self._loop.time() - self._last_heard
        if silent > KEEPALIVE_TIMEOUT and self.hearing():
            log.warning("%s: nothing heard for %.0fs; dropping the connection", self.name, silent)
            self.close(f"nothing heard for {silent:.0f}s")
            return
        self.tick()
        if self.closed is None:
            self._timer = self._loop.call_later(KEEPALIVE_INTERVAL, self._tick)

    # -- per side --------------------------------------------------------------------------

    def hello(self, said: bytes, target: str) -> None:
        """The other side's HELLO arrived (`said`: which of `hellos`; naming the broker it means to reach,
        if it says)."""

    def frame(self, sid: int, kind: int, payload: memoryview, size: int) -> None:
        raise NotImplementedError

    def lost(self, why: str) -> None:
        """The connection closed: fail every stream."""

    def tick(self) -> None:
        """Every KEEPALIVE_INTERVAL while open."""

    def hearing(self) -> bool:
        """Whether this side reads the connection now (one paused by us is not silent: it is unheard)."""
        return True


# -- the primary's side -----------------------------------------------------------------------


class _PrimaryConnection(_Connection):
    """A connection to a peer's replication port, opened by our `Dialer`."""

    def __init__(
        self, endpoint: str, member: str, forget: Callable[[_PrimaryConnection], None], token: str = ""
    ) -> None:
        super().__init__(f"replication to {member or '?'} at {endpoint}")
        self.endpoint = endpoint
        self.member = member
        self._token = token
        self.streams: dict[int, MuxReplicaStream] = {}
        self._next_sid = 1
        self._forget = forget
        self._idle_since = self._loop.time()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        said = [HELLO_PAYLOAD, (self.member or "-").encode()] if self.member or self._token else [HELLO_PAYLOAD]
        self.write(0, HELLO, b" ".join([*said, *([self._token.encode()] if self._token else [])]))

    def attach(self, stream: MuxReplicaStream) -> int:
        sid = self._next_sid
        self._next_sid += 1
        self.streams[sid] = stream
        return sid

    def detach(self, sid: int) -> None:
        if self.streams.pop(sid, None) is not None and not self.streams:
            self._idle_since = self._loop.time()

    def frame(self, sid: int, kind: int, payload: memoryview, size: int) -> None:
        if kind == RESPONSE:
            stream = self.streams.get(sid)
            if stream is not None:
                stream._deliver(pb.ReplicateResponse.FromString(payload))  # type: ignore[arg-type]  # parses any buffer; stubs say bytes
        elif kind == END and sid == 0:
            self.close(f"the peer refused the connection: {_end_error(bytes(payload))}")
        elif kind == END:
            stream = self.streams.get(sid)
            if stream is not None:
                stream._ended(_end_error(bytes(payload)) if len(payload) else None)
        elif kind not in (PONG, HELLO):
            self.close(f"the peer sent a frame of unknown kind {kind}")

    def tick(self) -> None:
        if not self.streams and self._loop.time() - self._idle_since > IDLE_CLOSE:
            self.close("idle")
            return
        self.write(0, PING)

    def lost(self, why: str) -> None:
        self._forget(self)
        streams, self.streams = self.streams, {}
        for stream in streams.values():
            stream._ended(why)


class MuxReplicaStream(Inbox):
    """A ReplicaStream over a `_PrimaryConnection` (possibly still being dialed)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self._conn: _PrimaryConnection | None = None
        self._sid = 0
        self._pending: list[tuple[int, bytes]] | None = []  # frames written before the connection was up
        self._responses: collections.deque[pb.ReplicateResponse] = collections.deque()
        self._error: str | None = None  # the stream failed (or we aborted it)
        self._eof = False  # the peer ended the stream cleanly
        self._ready = asyncio.get_running_loop().create_future()  # the connection is up (or failed)

    @property
    def ended(self) -> bool:
        """The stream is over: the peer ended it, or it broke."""
        return self._eof or self._error is not None

    def _connected(self, conn: _PrimaryConnection | None, error: str | None) -> None:
        pending, self._pending = self._pending, None
        if not self._ready.done():
            self._ready.set_result(None)
        if self._error is not None:  # aborted before the connection was up
            return
        if conn is None or conn.closed is not None:
            self._ended(f"cannot connect: {error or (conn and conn.closed)}")
            return
        self._conn = conn
        try:
            for kind, payload in pending or ():
                self._emit(kind, payload)
        except StreamError as exc:
            self._ended(str(exc))

    def _write(self, kind: int, payload: bytes) -> None:
        if self._error is not None:
            raise StreamError(f"peer {self.endpoint}: {self._error}")
        if self._eof:
            raise StreamError(f"peer {self.endpoint}: it ended the stream")
        if self._pending is not None:
            self._pending.append((kind, payload))
        else:
            self._emit(kind, payload)

    def _emit(self, kind: int, payload: bytes) -> None:
        """Write a frame on the connection. The stream takes its number with its first REQUEST (the
        peer opens streams by rising numbers); one that ends having sent none ends here, unheard."""
        assert self._conn is not None
        if not self._sid:
            if kind != REQUEST:
                if kind == CLOSE_SEND:
                    self._ended(None)
                return
            self._sid = self._conn.attach(self)
        try:
            self._conn.write(self._sid, kind, payload)
        except StreamError as exc:
            raise StreamError(f"peer {self.endpoint}: {exc}") from None

    def send(self, message: bytes) -> None:
        if not isinstance(message, bytes):
            raise TypeError(f"send() takes a serialized ReplicateRequest (bytes), not {type(message).__name__}")
        self._write(REQUEST, message)

    async def drain(self) -> None:
        """While dialing, wait for the connection (what was sent meanwhile is then written); then
        wait for its buffer to drain. StreamError if the connection failed; how the peer ended the
        stream is recv()'s to tell."""
        await asyncio.shield(self._ready)
        if self._conn is None:  # never connected (or aborted first); a peer's END is for recv() to tell
            raise StreamError(f"peer {self.endpoint}: {self._error}")
        try:
            await self._conn.drain()
        except StreamError as exc:
            raise StreamError(f"peer {self.endpoint}: {exc}") from None

    async def recv(self) -> pb.ReplicateResponse | None:
        while not self._responses:  # what arrived is handed out before how the stream ended
            if self._error is not None:
                raise StreamError(f"peer {self.endpoint}: {self._error}")
            if self._eof:
                return None
            if self._pending is None and not self._sid:
                raise StreamError(f"peer {self.endpoint}: nothing was sent on this stream to answer")
            await self._delivery()
        return self._responses.popleft()

    def close_send(self) -> None:
        with contextlib.suppress(StreamError):
            self._write(CLOSE_SEND, b"")

    def abort(self) -> None:
        if self._error is None and not self._eof and self._conn is not None and self._sid:
            with contextlib.suppress(StreamError):
                self._conn.write(self._sid, RESET)
        self._ended("aborted")

    def _deliver(self, resp: pb.ReplicateResponse) -> None:
        self._responses.append(resp)
        self._wake()

    def _ended(self, error: str | None) -> None:
        """The peer ended the stream (error None: cleanly), or it broke."""
        if error is None:
            self._eof = True
        elif self._error is None:
            self._error = error
        if self._conn is not None and self._sid:
            self._conn.detach(self._sid)
        self._wake()


class Dialer:
    """The primary's connections to its peers: one per peer, dialed on first use (with `tls`: over TLS,
    verifying each peer's certificate for the host dialled; `transport_tls.py`)."""

    def __init__(self, tls: TLS | None = None, authorizer: Authorizer | None = None) -> None:
        self._tls = transport_tls.contexts(tls)[1] if tls is not None else None
        self._authorizer = authorizer  # (signs the HELLO's REPLICATE token: peers with keys require one)
        self._conns: dict[tuple[str, str], _PrimaryConnection] = {}
        self._dialing: dict[tuple[str, str], asyncio.Task[_PrimaryConnection]] = {}

    def open(self, endpoint: str, member: str = "") -> MuxReplicaStream:
        """A new stream to `endpoint`; usable at once (frames wait for the connection). `member`
        ("zone/suffix") is the broker meant: one that is not (a stale endpoint) refuses the connection."""
        stream = MuxReplicaStream(endpoint)
        key = (endpoint, member)
        conn = self._conns.get(key)
        if conn is not None and conn.closed is None:
            stream._connected(conn, None)
            return stream
        task = self._dialing.get(key)
        if task is None:
            task = self._dialing[key] = asyncio.ensure_future(self._dial(endpoint, member))
            task.add_done_callback(lambda _: self._dialing.pop(key, None))

        def connected(t: asyncio.Task[_PrimaryConnection]) -> None:
            if t.cancelled():
                stream._connected(None, "dialing was cancelled")
            elif t.exception() is not None:
                stream._connected(None, str(t.exception()))
            else:
                stream._connected(t.result(), None)

        task.add_done_callback(connected)
        return stream

    async def _dial(self, endpoint: str, member: str) -> _PrimaryConnection:
        try:
            host, port = _split(endpoint)
            made = functools.partial(_PrimaryConnection, endpoint, member, self._forget, self._token())
            if self._tls is not None:
                conn = cast(_PrimaryConnection, await transport_tls.dial(host, port, self._tls, made, CONNECT_TIMEOUT))
            else:
                async with asyncio.timeout(CONNECT_TIMEOUT):
                    _transport, conn = await asyncio.get_running_loop().create_connection(made, host, port)
        except TimeoutError:
            raise StreamError(f"{endpoint}: not reachable within {CONNECT_TIMEOUT:g}s") from None
        except (OSError, ValueError) as exc:
            raise StreamError(f"{endpoint}: {exc or type(exc).__name__}") from None
        self._conns[(endpoint, member)] = conn
        return conn

    def _token(self) -> str:
        """A REPLICATE token for a new connection's HELLO ("" without keys)."""
        if self._authorizer is None:
            return ""
        header = dict(self._authorizer.metadata(Capability.REPLICATE)).get("authorization", "")
        return header.removeprefix("Bearer ")

    def _forget(self, conn: _PrimaryConnection) -> None:
        if self._conns.get((conn.endpoint, conn.member)) is conn:
            del self._conns[(conn.endpoint, conn.member)]

    async def aclose(self) -> None:
        for task in list(self._dialing.values()):
            task.cancel()
        for conn in list(self._conns.values()):
            conn.close("the broker is stopping")


# -- the peer's side --------------------------------------------------------------------------

Handler = Callable[[PeerStream], Coroutine[Any, Any, None]]


class _PeerConnection(_Connection):
    """A connection a primary opened to our replication port; each stream is served by `handler`."""

    def __init__(self, server: ReplicationServer) -> None:
        super().__init__("replication from ?")
        self._server = server
        self.streams: dict[int, _MuxPeerStream] = {}
        self._max_sid = 0
        self.inbound = 0  # bytes delivered to streams and not yet consumed
        self._reading = True
        self.quiet = False  # (its closing is logged elsewhere)
        self.claims: Claims | None = None  # (its HELLO's, when this broker has keys)
        self.calls: dict[int, RpcStream] | None = None  # a client's connection: its calls (transport_rpc.py)
        self.resetting: set[RpcStream] = set()  # calls the client reset whose handlers have not ended yet
        self._writes_paused_at = 0.0
        self.hellos = server.hellos

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.name = f"replication from {transport.get_extra_info('peername')}"
        self._server.connections.add(self)

    def hello(self, said: bytes, rest: str) -> None:
        """The primary's HELLO: "[BROKER|- [TOKEN]]". Refused: a token without REPLICATE (when this broker
        has keys), or a HELLO meant for another broker. A client's HELLO, "[BROKER]", opens a connection for
        its calls (each carries its own token), unless it was meant for another broker."""
        identity = self._server.identity
        if said == self._server.service.hello:
            if rest and identity and rest != identity:
                self.write(0, HELLO, said)
                self.refuse(f"it was meant for broker {rest}, but this is {identity} (a stale endpoint?)")
                return
            self.calls = {}
            self.name = self.name.replace("replication from", "client calls from", 1)
            self.write(0, HELLO, said)
            return
        target, _, token = rest.partition(" ")
        target = "" if target == "-" else target
        verifier = self._server.verifier
        if verifier is not None:
            try:
                # (its claims scope every stream of the connection: a REPLICATE token over app=a is no
                # key to app=b's replicas)
                self.claims = verifier.verify_metadata(
                    (("authorization", f"Bearer {token}"),) if token else (), _REPLICATE
                )
            except AuthError as exc:
                if exc.reason.startswith("no token"):  # (a broker's peer: not a client's flag to name)
                    exc = AuthError(exc.code, "no token: this broker has --auth-keys; give the primary's the same")
                self.write(0, HELLO, HELLO_PAYLOAD)  # a tidings peer, which refuses
                peer = self.transport.get_extra_info("peername") if self.transport is not None else None
                verifier.note_refusal("Replicate", f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "", exc)
                self.quiet = True  # (logged by the verifier, at most once per peer and reason every 10 s)
                self.refuse(exc.reason, grpc.StatusCode[exc.code])
                return
        if target and identity and target != identity:
            self.write(0, HELLO, HELLO_PAYLOAD)  # a tidings peer, which refuses
            self.refuse(f"it was meant for broker {target}, but this is {identity} (a stale endpoint?)")
            return
        self.write(0, HELLO, HELLO_PAYLOAD)

    def frame(self, sid: int, kind: int, payload: memoryview, size: int) -> None:
        if self.calls is not None:
            self._call_frame(self.calls, sid, kind, payload, size)
            return
        if kind == REQUEST:
            stream = self.streams.get(sid)
            if stream is None:
                if sid <= self._max_sid:
                    return  # a stream we already ended
                self._max_sid = sid
                stream = self.streams[sid] = _MuxPeerStream(self, sid)
                handler = self._server.handler
                assert handler is not None  # (a port without one accepts no replication HELLO)
                stream.task = self._loop.create_task(handler(stream), name=f"replicate:{sid}")
                stream.task.add_done_callback(functools.partial(self._served, stream))
            stream._queue(pb.ReplicateRequest.FromString(payload), size)  # type: ignore[arg-type]  # parses any buffer; stubs say bytes
        elif kind == CLOSE_SEND:
            if (stream := self.streams.get(sid)) is not None:
                stream._end_of_stream()
        elif kind == RESET:
            if (stream := self.streams.get(sid)) is not None:
                stream._reset("the primary reset the stream")
        elif kind == PING:
            self.write(0, PONG)
        else:
            self.close(f"the primary sent a frame of unknown kind {kind}")

    def _call_frame(self, calls: dict[int, RpcStream], sid: int, kind: int, payload: memoryview, size: int) -> None:
        """A frame of a client's call (transport_rpc.py)."""
        if kind == OPEN:
            if sid <= self._max_sid:
                self.close(f"call {sid} opened after call {self._max_sid} (calls are numbered upwards)")
                return
            self._max_sid = sid
            head = OPEN_HEAD.unpack_from(payload) if len(payload) >= OPEN_HEAD.size else None
            if head is None or OPEN_HEAD.size + head[1] > len(payload):
                self.close(f"call {sid} opened with a malformed OPEN ({len(payload)} bytes)")
                return
            number, token_length = head
            method = self._server.service.methods.get(number)
            if self._server.stopping:  # (as gRPC's server once stopped: the client retries another broker)
                self.write(sid, END, end_payload(grpc.StatusCode.UNAVAILABLE, "the broker is stopping; retry"))
                return
            if len(calls) >= MAX_CALLS:
                self.close(f"call {sid} opened beyond {MAX_CALLS} calls at once")
                return
            if size > self._server.service.max_request:
                self._too_large(sid, size)
                return
            if method is None:
                self.write(sid, END, end_payload(grpc.StatusCode.UNIMPLEMENTED, f"no method {number} here"))
                return
            start = OPEN_HEAD.size + token_length
            token = bytes(payload[OPEN_HEAD.size : start]).decode(errors="replace")
            first = method.request.FromString(payload[start:])  # type: ignore[arg-type]  # parses any buffer
            call = calls[sid] = RpcStream(self, sid, method)
            call.accept(first, size)
            peer = self.transport.get_extra_info("peername") if self.transport is not None else None
            ctx = Context(call, token, f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "")
            call.task = self._loop.create_task(serve_call(self._server.servicer, call, first, ctx), name=method.name)
            call.task.add_done_callback(lambda _: self._call_done(calls, call))
        elif kind == REQUEST:
            if (known := calls.get(sid)) is None:
                return
            if size > self._server.service.max_request:
                self._reset_call(calls, known)
                self._too_large(sid, size)
            elif not known.deliver(payload, size):
                self.close(f"call {sid} sent a request past its window, or to a {known.method.name} (which takes one)")
        elif kind == WINDOW:
            if len(payload) != GRANT.size:
                self.close(f"call {sid}'s WINDOW has {len(payload)} bytes, not {GRANT.size}")
            elif (known := calls.get(sid)) is not None:
                known.credit.grant(GRANT.unpack(payload)[0])
        elif kind == CLOSE_SEND:
            if (known := calls.get(sid)) is not None:
                known._end_of_stream()
        elif kind == RESET:
            if (known := calls.get(sid)) is not None:
                self._reset_call(calls, known)
        elif kind == PING:
            self.write(0, PONG)
        else:
            self.close(f"the client sent a frame of unknown kind {kind}")

    def served(self) -> list[RpcStream]:
        """The client's calls whose handlers have not ended (reset ones too)."""
        return [*(self.calls or {}).values(), *self.resetting]

    def _reset_call(self, calls: dict[int, RpcStream], call: RpcStream) -> None:
        """Cancel a call's handler; the call stops counting towards MAX_CALLS at once (the client counts it
        gone as it sends RESET), its handler towards what a stop waits for until it ends."""
        calls.pop(call.sid, None)
        self.resetting.add(call)
        call.reset()

    def _too_large(self, sid: int, size: int) -> None:
        limit = self._server.service.max_request
        why = f"a request of {size} bytes is over the limit of {limit}: send smaller messages"
        self.write(sid, END, end_payload(grpc.StatusCode.RESOURCE_EXHAUSTED, why))

    def _call_done(self, calls: dict[int, RpcStream], call: RpcStream) -> None:
        self.consumed(call.take_inbound())
        if calls.get(call.sid) is call:
            del calls[call.sid]
        self.resetting.discard(call)

    def _served(self, stream: _MuxPeerStream, task: asyncio.Task[None]) -> None:
        """A stream's handler ended: END it and forget it. A done-callback, not a `finally`: a handler
        cancelled before its first step (a RESET read with its first REQUEST) runs no code of its own."""
        exc = None if task.cancelled() else task.exception()
        if isinstance(exc, StreamError):
            log.debug("%s: stream %d: %s", self.name, stream.sid, exc)
        elif exc is not None:
            log.error("%s: stream %d failed", self.name, stream.sid, exc_info=exc)
            stream.end(end_payload(grpc.StatusCode.INTERNAL, "the peer failed serving the stream"))
        stream.end(b"")
        self.consumed(stream.take_inbound())
        self.streams.pop(stream.sid, None)

    def consumed(self, size: int) -> None:
        self.inbound -= size
        self._update_reading()

    def delivered(self, size: int) -> None:
        self.inbound += size
        self._update_reading()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._writes_paused_at = self._loop.time()
        self._update_reading()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._update_reading()

    def _update_reading(self) -> None:
        """Read while the streams hold under their limit of unconsumed bytes (a client's connection: a
        far higher one, as its calls' windows bound it and a RESET must be heard), and a client's while
        it reads what it is sent (one that does not would have us buffer our answers to it)."""
        if self.transport is None or self.closed is not None:
            return
        if self.calls is None:
            stop, go = self.inbound > INBOUND_HIGH, self.inbound < INBOUND_LOW
        else:
            stop = self.inbound > CLIENT_INBOUND_HIGH or self._paused
            go = not stop
        if self._reading and stop:
            self._reading = False
            self.transport.pause_reading()
        elif not self._reading and go:
            self._reading = True
            self._last_heard = self._loop.time()  # (not heard while we did not listen)
            self.transport.resume_reading()

    def hearing(self) -> bool:
        return self._reading

    def tick(self) -> None:
        """A client that has read nothing we sent for CLIENT_STALL seconds is frozen (a stopped process):
        its connection is dropped, as a silent one would be (we do not hear it while it does not read)."""
        if self.calls is not None and self._paused and self._loop.time() - self._writes_paused_at > CLIENT_STALL:
            self.close(f"the client read nothing of what it was sent for {CLIENT_STALL:g}s")

    def lost(self, why: str) -> None:
        self._server.connections.discard(self)
        if not self.quiet and not why.startswith(("connection", "the broker is stopping")):
            log.warning("%s: %s; closed it", self.name, why)
        for stream in list(self.streams.values()):
            stream._reset(why)
        for call in self.served():
            call.reset()


class _MuxPeerStream(Inbound[pb.ReplicateRequest]):
    """A PeerStream over a `_PeerConnection`."""

    def __init__(self, conn: _PeerConnection, sid: int) -> None:
        super().__init__(conn)
        self.conn = conn
        self.sid = sid
        self.task: asyncio.Task[None] | None = None
        self._error: str | None = None
        self._ended = False

    @property
    def claims(self) -> Claims | None:
        return self.conn.claims

    def _check(self) -> None:
        if self._error is not None:
            raise StreamError(self._error)

    async def recv(self) -> pb.ReplicateRequest | None:
        return await self._next_request()

    async def send(self, resp: pb.ReplicateResponse) -> None:
        if self._error is not None:
            raise StreamError(self._error)
        self.conn.write(self.sid, RESPONSE, resp.SerializeToString())
        await self.conn.drain()

    async def fail(self, code: grpc.StatusCode, message: str) -> None:
        self.end(end_payload(code, message))

    def end(self, payload: bytes) -> None:
        """Send END (once): empty for a clean end, else a status."""
        if self._ended:
            return
        self._ended = True
        if self._error is None and self.conn.closed is None:
            self.conn.write(self.sid, END, payload)

    def _reset(self, why: str) -> None:
        if self._error is None:
            self._error = why
            self._ended = True
            if self.task is not None:
                self.task.cancel()  # as gRPC cancels a handler whose call went away
        self._wake()


class ReplicationServer:
    """A broker's replication port: accepts primaries' connections and serves their streams, and with a
    `servicer` clients' calls of its `service` too (transport_rpc.py). A LogPlayer target's data port is
    one without a replication `handler`: the Target service's calls only."""

    def __init__(
        self,
        handler: Handler | None,
        identity: str = "",
        tls: TLS | None = None,
        verifier: Verifier | None = None,
        servicer: Servicer | None = None,
        service: Service = JOURNAL,
    ) -> None:
        assert handler is not None or servicer is not None, "a port serves replication, calls, or both"
        self.handler = handler
        self.servicer = servicer  # (the Journal service's: clients' calls are served too; transport_rpc.py)
        self.service = service
        protocols = [(HELLO_PAYLOAD, transport_tls.ALPN)] if handler is not None else []
        protocols += [(service.hello, service.alpn)] if servicer is not None else []
        self.hellos = tuple(hello for hello, _ in protocols)  # (what a connection's HELLO may say)
        self._alpn = tuple(alpn for _, alpn in protocols)
        self.identity = identity  # "zone/suffix": a primary that means another broker is refused
        self.verifier = verifier  # (a broker with keys: a HELLO must carry a REPLICATE token)
        self.connections: set[_PeerConnection] = set()
        self.endpoint = ""
        self.stopping = False  # (clients' new calls are refused: `drain_calls`)
        self._server: asyncio.Server | None = None
        assert tls is None or (tls.cert is not None and tls.key is not None), "a broker serving TLS has a certificate"
        self._tls = transport_tls.contexts(tls, list(self._alpn))[0] if tls is not None else None  # (a CA: mTLS)
        self._tls_listener: transport_tls.TLSListener | None = None

    async def start(self, listen: str) -> ReplicationServer:
        host, port = _split(listen)
        if self._tls is not None:
            self._tls_listener = transport_tls.TLSListener(self._tls, lambda: _PeerConnection(self), self._alpn)
            bound = await self._tls_listener.start(host, port)
        else:
            self._server = await asyncio.get_running_loop().create_server(
                lambda: _PeerConnection(self), host, port, reuse_address=True
            )
            bound = self._server.sockets[0].getsockname()[1]
        self.endpoint = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
        return self

    async def drain_calls(self, grace: float) -> None:
        """Refuse clients' new calls (UNAVAILABLE: they retry another broker) and give those being served up
        to `grace` seconds to end, as gRPC's `server.stop(grace)` does; `aclose` then cancels the rest."""
        self.stopping = True
        tasks = [call.task for c in self.connections for call in c.served() if call.task is not None]
        if tasks and grace > 0:
            await asyncio.wait(tasks, timeout=grace)

    async def aclose(self) -> None:
        """Stop accepting, close every connection (their handlers are cancelled) and wait for them."""
        if self._server is not None:
            self._server.close()
        if self._tls_listener is not None:
            self._tls_listener.close()
        tasks = [s.task for c in self.connections for s in c.streams.values() if s.task is not None]
        tasks += [call.task for c in self.connections for call in c.served() if call.task is not None]
        for conn in list(self.connections):
            conn.close("the broker is stopping")
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
