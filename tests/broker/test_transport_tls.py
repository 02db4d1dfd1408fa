"""The replication port over mutual TLS refuses, at the handshake, every peer it should: a plaintext
primary, one without a client certificate, one whose certificate another CA signed, one that
never finishes its handshake (bounded); a primary refuses a peer whose certificate it cannot verify.
Each refusal fails the stream with a StreamError naming the cause, is logged by the server in one
line, and the server goes on serving good primaries. A hostile peer after its handshake (a close_notify
and more bytes) costs only its own connection; a handshake still under way when the port closes
serves nothing. (The stream guarantees over TLS themselves:
tests/broker/test_transport.py, run in both modes.)"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl

import pytest

from tests.broker.test_transport import echo, req
from tests.support.certs import Certs
from tests.support.waiting import wait_until
from tidings.broker import transport_tls
from tidings.broker.transport import Dialer, ReplicationServer, StreamError
from tidings.tls import _load_chain


def _client_context(certs: Certs, cert: bool = True, by_other: bool = False, trust_ours: bool = True) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.set_alpn_protocols([transport_tls.ALPN])
    ctx.load_verify_locations(cadata=(certs.ca if trust_ours else certs.other).cert_pem.bytes().decode())
    if cert:
        c, k = certs.issue("primary", by_other=by_other)
        _load_chain(ctx, c.read_bytes(), k.read_bytes())
    return ctx


async def _serves_on(server: ReplicationServer, certs: Certs) -> None:
    dialer = Dialer(certs.tls("good-primary"))
    try:
        stream = dialer.open(server.endpoint)
        stream.send(req(b"ok"))
        assert (await asyncio.wait_for(stream.recv(), 10)).fragment.end == 2
    finally:
        await dialer.aclose()


@pytest.mark.parametrize(
    ("primary", "fails", "logged"),
    [
        ("plaintext", "connection (closed|lost)", "replication from 127.0.0.1: refused (TLS"),
        ("no-certificate", "alert certificate required", "replication from 127.0.0.1: refused (TLS"),
        ("other-ca", "alert unknown ca", "replication from 127.0.0.1: refused (TLS"),
        ("does-not-trust-the-peer", "TLS: self-signed certificate in certificate chain", ""),
    ],
)
async def test_a_peer_the_other_side_cannot_verify_is_refused_at_the_handshake(
    certs: Certs, caplog: pytest.LogCaptureFixture, primary: str, fails: str, logged: str
) -> None:
    server = await ReplicationServer(echo, tls=certs.tls("peer")).start("127.0.0.1:0")
    dialer = Dialer(None if primary == "plaintext" else certs.tls("primary"))
    dialer._tls = {
        "plaintext": None,
        "no-certificate": _client_context(certs, cert=False),
        "other-ca": _client_context(certs, by_other=True),
        "does-not-trust-the-peer": _client_context(certs, trust_ours=False),
    }[primary]
    try:
        with caplog.at_level(logging.WARNING, logger="tidings.broker.transport_tls"):
            stream = dialer.open(server.endpoint)
            stream.send(req(b"x"))
            with pytest.raises(StreamError, match=fails):
                await asyncio.wait_for(stream.recv(), 10)
            if logged:
                await wait_until(lambda: any(logged in r.getMessage() for r in caplog.records), 10)
        await _serves_on(server, certs)
    finally:
        await dialer.aclose()
        await server.aclose()


async def test_a_handshake_never_finished_is_dropped_and_the_port_serves_on(
    certs: Certs, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(transport_tls, "HANDSHAKE_TIMEOUT", 0.3)
    server = await ReplicationServer(echo, tls=certs.tls("peer")).start("127.0.0.1:0")
    host, port = server.endpoint.rsplit(":", 1)
    try:
        reader, writer = await asyncio.open_connection(host, int(port))  # connects, says nothing
        assert await asyncio.wait_for(reader.read(), 10) == b""  # dropped once the bound passed
        writer.close()
        await _serves_on(server, certs)
    finally:
        await server.aclose()


async def test_a_tls_primary_at_a_plaintext_port_fails_its_stream(certs: Certs) -> None:
    server = await ReplicationServer(echo).start("127.0.0.1:0")
    dialer = Dialer(certs.tls("primary"))
    try:
        stream = dialer.open(server.endpoint)
        stream.send(req(b"x"))
        with pytest.raises(StreamError, match="cannot connect"):
            await asyncio.wait_for(stream.recv(), 10)
    finally:
        await dialer.aclose()
        await server.aclose()


class _RawTLS:
    """A TLS client driven by hand over a socket, to say exactly what a hostile peer says."""

    def __init__(self, port: int, ctx: ssl.SSLContext) -> None:
        self.loop = asyncio.get_running_loop()
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setblocking(False)
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.ssl = ctx.wrap_bio(self.incoming, self.outgoing, server_hostname="127.0.0.1")

    async def step(self) -> bool:
        """One handshake step: True once done."""
        try:
            self.ssl.do_handshake()
            done = True
        except ssl.SSLWantReadError:
            done = False
        if self.outgoing.pending:
            await self.loop.sock_sendall(self.sock, self.outgoing.read())
        return done

    async def handshake(self) -> None:
        while not await self.step():
            self.incoming.write(await asyncio.wait_for(self.loop.sock_recv(self.sock, 65536), 10))

    async def closed_by_server(self) -> bool:
        """Read until the server closes the socket (EOF or reset)."""
        try:
            while await asyncio.wait_for(self.loop.sock_recv(self.sock, 65536), 10):
                pass
        except ConnectionResetError:
            pass
        return True


async def test_a_close_notify_followed_by_bytes_closes_that_connection_and_nothing_spins(certs: Certs) -> None:
    """After a peer's close_notify, OpenSSL reads 0 bytes without consuming what follows: the
    connection must end there, not loop on it (the broker's one event loop)."""
    server = await ReplicationServer(echo, tls=certs.tls("peer")).start("127.0.0.1:0")
    try:
        raw = _RawTLS(int(server.endpoint.rsplit(":", 1)[1]), _client_context(certs))
        await raw.handshake()
        with contextlib.suppress(ssl.SSLWantReadError):
            raw.ssl.unwrap()  # close_notify
        await raw.loop.sock_sendall(raw.sock, raw.outgoing.read() + b"x")
        assert await asyncio.wait_for(raw.closed_by_server(), 10)
        raw.sock.close()
        await _serves_on(server, certs)  # (the loop is free: this would time out behind a spinning read)
    finally:
        await server.aclose()


async def test_a_handshake_in_flight_when_the_port_closes_serves_nothing(certs: Certs) -> None:
    served = []

    async def handler(stream) -> None:
        served.append(stream)
        await echo(stream)

    server = await ReplicationServer(handler, tls=certs.tls("peer")).start("127.0.0.1:0")
    raw = _RawTLS(int(server.endpoint.rsplit(":", 1)[1]), _client_context(certs))
    await raw.step()  # ClientHello sent; the server's handshake is under way
    await wait_until(lambda: server._tls_listener is not None and server._tls_listener._handshaking, 10)
    await server.aclose()
    assert await asyncio.wait_for(raw.closed_by_server(), 10)
    raw.sock.close()
    assert not served and not server.connections


async def test_a_client_of_another_protocol_is_refused_at_the_handshake(certs: Certs, caplog) -> None:
    """ALPN: OpenSSL goes on when the two sides name no protocol in common; the port must not."""
    server = await ReplicationServer(echo, tls=certs.tls("peer")).start("127.0.0.1:0")
    ctx = _client_context(certs)
    ctx.set_alpn_protocols(["h2"])  # (a gRPC client at the replication port)
    try:
        with caplog.at_level(logging.WARNING, logger="tidings.broker.transport_tls"):
            raw = _RawTLS(int(server.endpoint.rsplit(":", 1)[1]), ctx)
            with contextlib.suppress(ssl.SSLError, ConnectionResetError, TimeoutError):
                await raw.handshake()
            assert await asyncio.wait_for(raw.closed_by_server(), 10)
            raw.sock.close()
            await wait_until(lambda: any("not tidings-replicate/1" in r.getMessage() for r in caplog.records), 10)
        await _serves_on(server, certs)
    finally:
        await server.aclose()
