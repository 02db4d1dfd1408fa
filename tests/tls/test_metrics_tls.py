"""/metrics over TLS (`--metrics-tls`, member/serving.py): served with the process's certificate, only to
scrapers holding a certificate of its CA when it has one (mutual TLS); a plaintext scraper, one without
a certificate, garbage, or a client that connects and never shakes hands is refused or waits alone,
and every other scrape is answered. A real broker serves it too."""

from __future__ import annotations

import http.client
import os
import socket
import ssl
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.support.certs import Certs
from tidings.member import serving
from tidings.member.serving import serve_metrics, stop_metrics


@contextmanager
def metrics_server(tls) -> Iterator[tuple[str, int]]:
    server, endpoint = serve_metrics("127.0.0.1:0", "127.0.0.1", 0, "test", tls)
    try:
        host, port = endpoint.rsplit(":", 1)
        yield host, int(port)
    finally:
        stop_metrics(server)
        server.server_close()


def scrape(host: str, port: int, ctx: ssl.SSLContext | None, timeout: float = 30.0) -> bytes:
    conn = (
        http.client.HTTPSConnection(host, port, context=ctx, timeout=timeout)
        if ctx is not None
        else http.client.HTTPConnection(host, port, timeout=timeout)
    )
    try:
        conn.request("GET", "/metrics")
        answer = conn.getresponse()
        assert answer.status == 200
        return answer.read()
    finally:
        conn.close()


def scraper(certs: Certs, with_cert: bool = True) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(certs.ca_file))
    if with_cert:
        ctx.load_cert_chain(*certs.issue("prometheus"))
    return ctx


def test_metrics_over_mutual_tls_answer_only_scrapers_with_a_certificate_of_the_ca(certs: Certs) -> None:
    with metrics_server(certs.tls("metrics")) as (host, port):
        assert b"# TYPE" in scrape(host, port, scraper(certs))
        with pytest.raises((ssl.SSLError, ConnectionError)):  # (TLS 1.3: refused at the first read)
            scrape(host, port, scraper(certs, with_cert=False))
        with pytest.raises((http.client.HTTPException, ConnectionError)):  # (plaintext: no HTTP answer)
            scrape(host, port, None)
        foreign = ssl.create_default_context(cafile=str(certs.ca_file))
        foreign.load_cert_chain(*certs.issue("foreign", by_other=True))
        with pytest.raises((ssl.SSLError, ConnectionError)):
            scrape(host, port, foreign)
        for junk in (os.urandom(4096), b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"):
            with socket.create_connection((host, port), timeout=30) as raw:
                raw.sendall(junk)
                try:
                    answer = raw.recv(65536)  # (closed on us, or a TLS alert: never an HTTP answer)
                except ConnectionResetError:
                    answer = b""
                assert not answer.startswith(b"HTTP/")
        assert b"# TYPE" in scrape(host, port, scraper(certs))  # (and it serves on)


def test_without_a_ca_any_tls_scraper_is_answered(certs: Certs) -> None:
    with metrics_server(certs.tls("metrics", ca=False)) as (host, port):
        assert b"# TYPE" in scrape(host, port, scraper(certs, with_cert=False))


def test_a_client_that_never_shakes_hands_stalls_no_other_scrape(certs: Certs, monkeypatch) -> None:
    """Handshakes run in each connection's own thread: with the handshake bound raised above the scrape's
    own timeout, a silent connection held open must not delay the next scrape (a server shaking hands
    in its accepting thread would answer nobody until the silent one gave up)."""
    monkeypatch.setattr(serving, "METRICS_HANDSHAKE_TIMEOUT", 120.0)
    with metrics_server(certs.tls("metrics")) as (host, port):
        silent = [socket.create_connection((host, port), timeout=30) for _ in range(3)]
        try:
            assert b"# TYPE" in scrape(host, port, scraper(certs), timeout=30.0)
        finally:
            for s in silent:
                s.close()


async def test_a_broker_serves_metrics_over_tls_with_its_certificate(brokers, certs: Certs) -> None:
    import asyncio

    bs = await brokers(tls=certs.tls("broker"), metrics_listen="auto", metrics_tls=True)
    b = await bs.add_broker("zone-a")
    host, port = b.metrics_endpoint.rsplit(":", 1)
    body = await asyncio.to_thread(scrape, host, int(port), scraper(certs))
    assert b"tidings_journals" in body
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        await asyncio.to_thread(scrape, host, int(port), None)
