"""The replication transport on its own: framing, multiplexing, and every way a stream can fail,
each in plaintext and over mutual TLS (`transport_tls.py`: the same guarantees on TLS sockets).

A real ReplicationServer and Dialer on loopback; the handler stands in for the broker's
`serve_replicate` (echoing, refusing, or not reading), so each failure is driven exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest

from tests.support.waiting import wait_until
from tidings.broker import transport, transport_tls
from tidings.broker.transport import (
    HEADER,
    HELLO,
    HELLO_PAYLOAD,
    REQUEST,
    Dialer,
    PeerStream,
    ReplicationServer,
    StreamError,
)
from tidings.protocol import protocol_pb2 as pb
from tidings.tls import TLS

_tls: TLS | None = None  # this test's: None (plaintext) or mutual TLS


@pytest.fixture(autouse=True, params=["plaintext", "tls"])
def security(request: pytest.FixtureRequest, certs) -> TLS | None:
    global _tls
    _tls = certs.tls("replication") if request.param == "tls" else None
    return _tls


async def echo(stream: PeerStream) -> None:
    """Answer every request with its content's length (as a fragment end), until end of stream."""
    while (req := await stream.recv()) is not None:
        await stream.send(pb.ReplicateResponse(status=pb.OK, fragment=pb.Fragment(end=len(req.content))))


@contextlib.asynccontextmanager
async def serving(handler: Callable[[PeerStream], Awaitable[None]] = echo) -> AsyncIterator[ReplicationServer]:
    server = await ReplicationServer(handler, tls=_tls).start("127.0.0.1:0")
    try:
        yield server
    finally:
        await server.aclose()


@contextlib.asynccontextmanager
async def dialing() -> AsyncIterator[Dialer]:
    dialer = Dialer(_tls)
    try:
        yield dialer
    finally:
        await dialer.aclose()


def req(content: bytes = b"", ack: bool = True) -> bytes:
    return pb.ReplicateRequest(content=content, acknowledge=ack).SerializeToString()


async def test_requests_are_answered_in_order_and_end_of_stream_is_clean() -> None:
    async with serving() as server, dialing() as dialer:
        stream = dialer.open(server.endpoint)
        for n in (1, 10, 100_000, 3 * 1024 * 1024):  # small, and large enough to take many reads
            stream.send(req(b"x" * n))
        await stream.drain()
        assert [(await stream.recv()).fragment.end for _ in range(4)] == [1, 10, 100_000, 3 * 1024 * 1024]
        stream.close_send()
        assert await stream.recv() is None
        assert stream.ended


async def test_contents_of_every_size_around_a_record_arrive_whole_and_in_order() -> None:
    """Frames whose header rides with the start of the content (TLS: in one record) and frames of
    every size around a TLS record (16 KiB), the one-copy frame (64 KiB) and a write slice (256 KiB)."""

    async def digest(stream: PeerStream) -> None:
        while (r := await stream.recv()) is not None:
            sha = hashlib.sha1(r.content).hexdigest()
            await stream.send(pb.ReplicateResponse(fragment=pb.Fragment(end=len(r.content), journal=sha)))

    sizes = [0, 1, 1000, 1023, 1024, 16_000, 16_383, 16_384, 16_385, 65_535, 65_536, 65_537, 262_143, 262_145]
    bodies = [os.urandom(n) for n in [*sizes, 1_048_579]]
    async with serving(digest) as server, dialing() as dialer:
        stream = dialer.open(server.endpoint)
        for body in bodies:
            stream.send(req(body))
        await stream.drain()
        got = [(await stream.recv()).fragment for _ in bodies]
        assert [(f.end, f.journal) for f in got] == [(len(b), hashlib.sha1(b).hexdigest()) for b in bodies]


async def test_streams_to_one_peer_share_one_connection() -> None:
    async with serving() as server, dialing() as dialer:
        streams = [dialer.open(server.endpoint) for _ in range(50)]
        for i, s in enumerate(streams):
            s.send(req(b"y" * i))
        for i, s in enumerate(streams):
            assert (await s.recv()).fragment.end == i
        assert len(server.connections) == 1
        for s in streams:
            s.close_send()
            assert await s.recv() is None
        await wait_until(lambda: not next(iter(server.connections)).streams, 5)


async def test_a_peer_that_fails_a_stream_reports_its_status_and_others_go_on() -> None:
    async def refuse(stream: PeerStream) -> None:
        first = await stream.recv()
        if first is not None and first.content == b"bad":
            await stream.fail(grpc.StatusCode.INVALID_ARGUMENT, "bad content")
            return
        await echo_from(stream, first)

    async def echo_from(stream: PeerStream, first: pb.ReplicateRequest | None) -> None:
        while first is not None:
            await stream.send(pb.ReplicateResponse(fragment=pb.Fragment(end=len(first.content))))
            first = await stream.recv()

    async with serving(refuse) as server, dialing() as dialer:
        bad, good = dialer.open(server.endpoint), dialer.open(server.endpoint)
        bad.send(req(b"bad"))
        good.send(req(b"good"))
        with pytest.raises(StreamError, match="INVALID_ARGUMENT: bad content"):
            await bad.recv()
        with pytest.raises(StreamError):
            bad.send(req(b"more"))  # a failed stream takes nothing more
        assert (await good.recv()).fragment.end == 4
        good.send(req(b"still"))
        assert (await good.recv()).fragment.end == 5


async def test_abort_cancels_the_peers_handler() -> None:
    finished = asyncio.Event()
    started = asyncio.Event()

    async def wait_forever(stream: PeerStream) -> None:
        try:
            await stream.recv()
            started.set()
            await asyncio.Event().wait()
        finally:
            finished.set()

    async with serving(wait_forever) as server, dialing() as dialer:
        stream = dialer.open(server.endpoint)
        stream.send(req())
        await asyncio.wait_for(started.wait(), 5)
        stream.abort()
        await asyncio.wait_for(finished.wait(), 5)
        with pytest.raises(StreamError, match="aborted"):
            await stream.recv()


async def test_a_lost_connection_fails_every_stream_and_the_next_one_redials() -> None:
    async with serving() as server, dialing() as dialer:
        streams = [dialer.open(server.endpoint) for _ in range(3)]
        for s in streams:
            s.send(req(b"a"))
            assert (await s.recv()).fragment.end == 1
        for conn in list(server.connections):
            conn.close("test")
        for s in streams:
            with pytest.raises(StreamError, match="connection"):
                await s.recv()
        again = dialer.open(server.endpoint)
        again.send(req(b"bb"))
        assert (await again.recv()).fragment.end == 2


async def test_nobody_listening_fails_the_stream() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with dialing() as dialer:
        stream = dialer.open(f"127.0.0.1:{port}")
        stream.send(req())  # accepted while dialing
        with pytest.raises(StreamError, match="cannot connect"):
            await stream.recv()


async def raw_connection(server: ReplicationServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = server.endpoint.rsplit(":", 1)
    return await asyncio.open_connection(host, int(port), ssl=transport_tls.contexts(_tls)[1] if _tls else None)


@pytest.mark.parametrize(
    "junk",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # another protocol
        HEADER.pack(len(b"nope"), 0, HELLO) + b"nope",  # a HELLO of something else
        HEADER.pack(len(HELLO_PAYLOAD), 0, HELLO) + HELLO_PAYLOAD + HEADER.pack(transport.MAX_FRAME + 1, 1, REQUEST),
        HEADER.pack(len(HELLO_PAYLOAD), 0, HELLO) + HELLO_PAYLOAD + HEADER.pack(3, 1, REQUEST) + b"\xff\xff\xff",
        HEADER.pack(len(HELLO_PAYLOAD), 0, HELLO) + HELLO_PAYLOAD + HEADER.pack(0, 1, 99),  # unknown kind
    ],
    ids=["http", "wrong-hello", "over-limit", "unparsable", "unknown-kind"],
)
async def test_garbage_closes_that_connection_and_the_server_serves_on(junk: bytes) -> None:
    async with serving() as server, dialing() as dialer:
        reader, writer = await raw_connection(server)
        writer.write(junk)
        await writer.drain()
        await asyncio.wait_for(reader.read(), 5)  # read to EOF: the server closed the connection
        writer.close()
        stream = dialer.open(server.endpoint)
        stream.send(req(b"ok"))
        assert (await stream.recv()).fragment.end == 2


async def test_a_silent_peer_is_dropped_by_keepalive(monkeypatch: pytest.MonkeyPatch) -> None:
    """A half-open connection (a frozen peer: accepts, never answers) fails the stream, not hangs it."""
    monkeypatch.setattr(transport, "KEEPALIVE_INTERVAL", 0.05)
    monkeypatch.setattr(transport, "KEEPALIVE_TIMEOUT", 0.3)
    accepted: list[asyncio.StreamWriter] = []

    async def frozen(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)  # never reads, never writes

    ssl = transport_tls.contexts(_tls)[0] if _tls else None  # (over TLS: frozen once the handshake is done)
    silent = await asyncio.start_server(frozen, "127.0.0.1", 0, ssl=ssl)
    try:
        port = silent.sockets[0].getsockname()[1]
        async with dialing() as dialer:
            stream = dialer.open(f"127.0.0.1:{port}")
            stream.send(req())
            with pytest.raises(StreamError, match="nothing heard"):
                await asyncio.wait_for(stream.recv(), 10)
    finally:
        for w in accepted:
            w.close()
        silent.close()
        await silent.wait_closed()


async def test_a_peer_that_stops_reading_stops_its_primary_with_bounded_memory() -> None:
    """Flow control end to end: a handler that does not consume makes the peer stop reading its
    socket, the primary's buffer fills and drain() waits; once the handler reads, all goes through."""
    go = asyncio.Event()
    received = 0

    async def slow(stream: PeerStream) -> None:
        nonlocal received
        await go.wait()
        while (r := await stream.recv()) is not None:
            received += len(r.content)

    chunk = b"z" * (1024 * 1024)
    async with serving(slow) as server, dialing() as dialer:
        stream = dialer.open(server.endpoint)
        sent = 0
        blocked = False
        while sent < 256 * len(chunk):
            stream.send(req(chunk, ack=False))
            sent += len(chunk)
            try:
                await asyncio.wait_for(stream.drain(), 0.5)
            except TimeoutError:
                blocked = True
                break
        assert blocked, "drain() never waited although nothing was consumed"
        conn = next(iter(server.connections))
        assert conn.inbound <= transport.INBOUND_HIGH + len(chunk) + 1024, "the peer buffered without bound"
        go.set()
        await asyncio.wait_for(stream.drain(), 30)
        stream.close_send()
        assert await asyncio.wait_for(stream.recv(), 30) is None
        assert received == sent


# -- stream lifetimes at the edges -------------------------------------------------------------


async def connected(server: ReplicationServer, dialer: Dialer) -> transport._PeerConnection:
    """Bring the one connection up (a stream answered and ended) and return the server's end of it."""
    warm = dialer.open(server.endpoint)
    warm.send(req(b"w"))
    assert (await warm.recv()).fragment.end == 1
    warm.close_send()
    assert await warm.recv() is None
    (conn,) = server.connections
    await wait_until(lambda: not conn.streams and conn.inbound == 0, 5)
    return conn


async def test_a_reset_read_with_the_first_request_leaves_nothing_behind() -> None:
    """RESET in the same read as the stream's first REQUEST cancels the handler task before its
    first step: `_serve`'s finally never runs, so the stream stays in `conn.streams` and its
    request's bytes stay counted in `conn.inbound` for the connection's life."""
    async with serving() as server, dialing() as dialer:
        conn = await connected(server, dialer)
        for _ in range(3):
            stream = dialer.open(server.endpoint)
            stream.send(req(b"z" * 1000))
            stream.abort()  # both frames are in the peer's socket before its loop reads either
        probe = dialer.open(server.endpoint)  # its frames follow the RESETs: once answered, they were read
        probe.send(req(b"p"))
        assert (await probe.recv()).fragment.end == 1
        probe.close_send()
        assert await probe.recv() is None
        await wait_until(lambda: conn.inbound == 0 and not conn.streams, 5)


async def test_reset_first_requests_stall_every_later_stream_of_the_connection() -> None:
    """The leaked count is never given back: once it passes INBOUND_HIGH the connection stops
    reading for good and every other stream to that peer hangs (until keep-alive drops it all)."""
    async with serving() as server, dialing() as dialer:
        conn = await connected(server, dialer)
        big = dialer.open(server.endpoint)
        big.send(req(b"b" * (transport.INBOUND_HIGH + 1024)))
        big.abort()
        await wait_until(lambda: conn._max_sid == big._sid, 10)  # the peer has read the big request
        other = dialer.open(server.endpoint)
        other.send(req(b"o"))
        await other.drain()
        resp = await asyncio.wait_for(other.recv(), 5)  # TimeoutError: the connection is paused for good
        assert resp is not None and resp.fragment.end == 1


async def test_a_stream_that_speaks_after_a_later_opened_one_is_still_served() -> None:
    """Dialer.open says a stream is usable at once, but its id is fixed at open: a stream whose first
    REQUEST goes out after a later-opened stream's is taken by the peer for one already ended and
    dropped silently; no END, no RESET, the connection stays healthy, and recv() never returns."""
    async with serving() as server, dialing() as dialer:
        await connected(server, dialer)
        first, second = dialer.open(server.endpoint), dialer.open(server.endpoint)
        second.send(req(b"22"))
        assert (await second.recv()).fragment.end == 2
        first.send(req(b"1"))
        resp = await asyncio.wait_for(first.recv(), 5)  # TimeoutError: the frame was dropped
        assert resp is not None and resp.fragment.end == 1


async def test_close_send_on_a_stream_that_sent_nothing_ends_it() -> None:
    """close_send() promises the peer ends its side; a stream that never sent a REQUEST is unknown
    to the peer, so no END ever comes (a pipeline whose first scatter failed before sending waits
    out TEARDOWN_TIMEOUT here)."""
    async with serving() as server, dialing() as dialer:
        await connected(server, dialer)
        stream = dialer.open(server.endpoint)
        stream.close_send()
        await stream.drain()
        assert await asyncio.wait_for(stream.recv(), 5) is None


async def test_a_primary_that_means_another_broker_is_refused() -> None:
    """A stale endpoint (the peer restarted elsewhere, another broker took its port) must not carry a
    stream to the wrong broker: HELLO names the broker meant, and any other refuses the connection."""
    server = await ReplicationServer(echo, "zone-a/b1", tls=_tls).start("127.0.0.1:0")
    try:
        async with dialing() as dialer:
            wrong = dialer.open(server.endpoint, "zone-a/b2")
            wrong.send(req(b"x"))
            with pytest.raises(StreamError, match="meant for broker zone-a/b2"):
                await asyncio.wait_for(wrong.recv(), 5)
            right = dialer.open(server.endpoint, "zone-a/b1")
            right.send(req(b"xy"))
            assert (await right.recv()).fragment.end == 2
    finally:
        await server.aclose()
