"""The replication port over mutual TLS refuses, at the handshake, every peer it should: a plaintext
primary, one without a client certificate, one whose certificate another CA signed, one that
never finishes its handshake (bounded); a primary refuses a peer whose certificate it cannot verify.
Each refusal fails the stream with a StreamError naming the cause, is logged by the server in one
line, and the server goes on serving good primaries. (The stream guarantees over TLS themselves:
tests/broker/test_transport.py, run in both modes.)"""

from __future__ import annotations

import asyncio
import logging
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
        ("plaintext", "connection (closed|lost)", "replication from 127.0.0.1: refused at the TLS handshake"),
        ("no-certificate", "alert certificate required", "replication from 127.0.0.1: refused at the TLS handshake"),
        ("other-ca", "alert unknown ca", "replication from 127.0.0.1: refused at the TLS handshake"),
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
