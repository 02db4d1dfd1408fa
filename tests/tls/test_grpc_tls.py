"""TLS on the gRPC services and the replication port (tidings/tls.py, broker/transport_tls.py): brokers
given --tls-cert/--tls-key/--tls-ca serve only TLS, require client certificates from their CA (mutual
TLS) and dial and replicate to each other with TLS; a client with
the CA and a certificate appends and reads through every broker. Every mismatch a user makes (no TLS
at a TLS port, TLS at a plaintext one, the wrong CA, no or a foreign client certificate, an expired
certificate, a certificate for another host name) ends the `tidings` command with one line naming the
cause and what to do, no traceback; a broker whose own certificate is expired or not valid for the
address it announces refuses to start, in one line. Real brokers and etcd."""

from __future__ import annotations

import asyncio

import pytest

from tests.cli._support import run
from tests.support.certs import Certs
from tidings.client import AsyncClient
from tidings.protocol.status import TransportError, UsageError


async def test_a_tls_cluster_serves_appends_and_reads_through_every_broker(brokers, certs: Certs) -> None:
    bs = await brokers(tls=certs.tls("broker"))
    for zone in ("zone-a", "zone-b"):
        await bs.add_broker(zone)
    await bs.create_journal("tls/j", 2)  # (replicated over TLS; appends through the non-primary are proxied)
    written = []
    for i in range(2):
        async with bs.client(i) as c:
            await c.append("tls/j", f"<via {i}>".encode())
            written.append(f"<via {i}>".encode())
    for i in range(2):
        async with bs.client(i) as c:
            assert await c.read_all("tls/j") == b"".join(written)
    async with AsyncClient(bs.brokers[0].endpoint, retries=0, fail_fast=True) as plain:
        with pytest.raises(TransportError, match="speaks TLS: pass --tls-ca"):
            await plain.list()


@pytest.mark.parametrize("transport", ["tidings", "grpc"])
async def test_an_ipv6_address_written_in_full_names_a_tls_broker(brokers, certs: Certs, transport: str) -> None:
    """An IPv6 address has many spellings (`0:0:0:0:0:0:0:1` is `::1`, `fd7d:0f65::11` is `fd7d:f65::11`);
    gRPC checks a certificate's address against the host as text in its shortest form. Brokers listening
    at a long spelling announce the short one, and a client dialing a long one gets through."""
    tls = certs.tls("wide")  # (127.0.0.1, ::1 and localhost)
    bs = await brokers(tls=tls)
    for zone in ("zone-a", "zone-b"):
        b = await bs.add_broker(zone, listen="[0:0:0:0:0:0:0:1]:0")
        assert b.endpoint.startswith("[::1]:"), b.endpoint
    await bs.create_journal("tls/v6", 2)  # (replicated, and proxied from the non-primary, between them)
    written = b""
    for b in bs.brokers:
        port = b.endpoint.rpartition(":")[2]
        async with AsyncClient(f"[0:0:0:0:0:0:0:1]:{port}", tls=tls, transport=transport, retries=0) as c:
            await c.append("tls/v6", b"<%s>" % port.encode())
            written += b"<%s>" % port.encode()
            assert await c.read_all("tls/v6") == written


def _one_line(r) -> str:
    text = r.stderr.decode()
    assert r.returncode != 0 and "Traceback" not in text and text.count("\n") == 1, text
    return text


async def test_every_mismatch_is_one_line_naming_its_cause(brokers, certs: Certs) -> None:
    bs = await brokers(tls=certs.tls("broker"))
    ep = (await bs.add_broker("zone-a")).endpoint
    client_cert, client_key = certs.issue("client")
    foreign_cert, foreign_key = certs.issue("foreign", by_other=True)
    ca, other_ca = str(certs.ca_file), str(certs.other_ca_file)
    mine = ("--tls-cert", str(client_cert), "--tls-key", str(client_key))
    cases = [
        ((), f"TLS: {ep} speaks TLS: pass --tls-ca"),
        (("--tls-ca", other_ca, *mine), "its certificate is not signed by the CA in --tls-ca: give that CA"),
        (("--tls-ca", ca), f"TLS: {ep} requires a client certificate: pass --tls-cert and --tls-key"),
        (("--tls-ca", ca, "--tls-cert", str(foreign_cert), "--tls-key", str(foreign_key)),
         f"TLS: {ep} refused our client certificate"),
    ]  # fmt: skip
    for flags, says in cases:
        assert says in _one_line(await run("journals", "list", *flags, broker=ep)), flags
    r = await run("journals", "list", "--tls-ca", ca, *mine, broker=ep)
    assert r.returncode == 0, r.stderr


async def test_tls_at_a_plaintext_broker_is_one_line(brokers, certs: Certs) -> None:
    plain = await brokers()
    ep = (await plain.add_broker("zone-a")).endpoint
    cert, key = certs.issue("client")
    r = await run("journals", "list", "--tls-ca", str(certs.ca_file), "--tls-cert", str(cert), "--tls-key", str(key),
                  broker=ep)  # fmt: skip
    assert f"TLS: {ep} does not speak TLS (a plaintext server)" in _one_line(r)


@pytest.mark.parametrize(
    ("cert", "says"),
    [
        ({"expired": True}, "certificate failed verification (certificate has expired): its certificate has expired"),
        ({"hosts": ("tidings.example",)}, "certificate is not valid for 127.0.0.1: dial a name or address"),
    ],
    ids=["expired", "wrong-name"],
)
async def test_a_server_certificate_a_client_cannot_accept_is_named(brokers, certs: Certs, cert, says) -> None:
    """(A broker without --tls-ca does not check its own certificate: its clients find out, in one line.)"""
    tls = certs.tls("bad-server", *cert.get("hosts", ()), ca=False, expired=cert.get("expired", False))
    bs = await brokers(tls=tls)
    ep = (await bs.add_broker("zone-a")).endpoint
    assert says in _one_line(await run("journals", "list", "--tls-ca", str(certs.ca_file), broker=ep))


@pytest.mark.parametrize(
    ("cert", "says"),
    [
        ({"expired": True}, "its certificate: certificate has expired: renew it"),
        ({"hosts": ("tidings.example",)}, "IP address mismatch, certificate is not valid for '127.0.0.1'"),
    ],
    ids=["expired", "wrong-name"],
)
async def test_a_broker_refuses_to_serve_a_certificate_its_peers_would_refuse(brokers, certs: Certs, cert, says):
    tls = certs.tls("own", *cert.get("hosts", ()), expired=cert.get("expired", False))
    bs = await brokers(tls=tls)
    with pytest.raises(UsageError, match=r"cannot serve TLS at 127\.0\.0\.1:") as refused:
        await bs.add_broker("zone-a")
    assert says in str(refused.value) and "\n" not in str(refused.value)


async def test_garbage_on_every_port_of_a_secured_broker_is_refused_and_it_serves_on(brokers, certs: Certs) -> None:
    """A broker on mutual TLS holding keys, its gRPC, replication and metrics ports each sent junk: random
    bytes, an HTTP/1 request, and the same inside a TLS session made with a certificate of our CA (past
    the handshake, before any token): each connection ends, nothing is written, and it serves on."""
    import os
    import ssl

    from tidings.auth import KeySet, generate_key

    bs = await brokers(tls=certs.tls("broker"), auth_keys=KeySet.parse(generate_key()), metrics_listen="auto")
    b = await bs.add_broker("zone-a")
    await bs.create_journal("tls/junk", 1)
    async with bs.client() as c:
        head = await c.write_head("tls/junk")
    cert, key = certs.issue("junk-client")
    ctx = ssl.create_default_context(cafile=str(certs.ca_file))
    ctx.load_cert_chain(cert, key)
    ports = {"grpc": b.endpoint, "replication": b.replication.endpoint, "metrics": b.metrics_endpoint}
    junks = [os.urandom(4096), b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"]
    for name, endpoint in ports.items():
        host, port = endpoint.rsplit(":", 1)
        for junk in junks:
            for secure in (False, True) if name != "metrics" else (False,):
                try:
                    reader, writer = await asyncio.open_connection(host, int(port), ssl=ctx if secure else None)
                    writer.write(junk)
                    await writer.drain()
                    await asyncio.wait_for(reader.read(65536), 10)  # (answered or closed: never held open)
                    writer.close()
                except (ConnectionError, ssl.SSLError):
                    pass  # (closed on us: a refusal)
    async with bs.client() as c:
        assert await c.write_head("tls/junk") == head  # (nothing written)
        await c.append("tls/junk", b"still serving")
