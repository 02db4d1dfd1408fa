"""/metrics over TLS (`--metrics-tls`, member/serving.py): served with the process's certificate, only to
scrapers holding a certificate of its CA when it has one (mutual TLS); a plaintext scraper, one without
a certificate, garbage, or a client that connects and never shakes hands is refused or waits alone,
and every other scrape is answered. No connection outlives the deadline, however slowly it trickles;
connections beyond the cap are closed at once; a scraper hanging up mid-answer prints no traceback.
A real broker serves it too, and announces it as https."""

from __future__ import annotations

import http.client
import os
import socket
import ssl
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.support.certs import Certs
from tests.support.waiting import wait_until_sync
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


def test_a_scraper_hanging_up_mid_answer_prints_no_traceback(certs: Certs, capfd) -> None:
    with metrics_server(certs.tls("metrics")) as (host, port):
        ctx = scraper(certs)
        for _ in range(3):
            with (
                socket.create_connection((host, port), timeout=30) as raw,
                ctx.wrap_socket(raw, server_hostname=host) as tls,
            ):
                tls.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")  # (and gone before the answer)
        assert b"# TYPE" in scrape(host, port, ctx)  # (the three were answered, or failed to be: it serves on)
    assert "Traceback" not in capfd.readouterr().err


def closed_by_server(sock, trickle: bytes = b"", every: float = 0.2, bound: float = 60.0) -> bool:
    """Whether the server closes `sock` within `bound` seconds (sending `trickle` a byte at a time, paced
    by `every`, meanwhile)."""
    sock.settimeout(every)
    end = time.monotonic() + bound
    sent = 0
    while time.monotonic() < end:
        try:
            if sock.recv(65536) == b"":
                return True
        except TimeoutError:
            pass
        except (ConnectionError, ssl.SSLError):
            return True
        try:
            if sent < len(trickle):
                sock.sendall(trickle[sent : sent + 1])
                sent += 1
        except (ConnectionError, ssl.SSLError):
            return True
    return False


def test_no_connection_outlives_the_deadline(certs: Certs, monkeypatch) -> None:
    """A client that never shakes hands (the handshake bound raised far above the deadline), and one that
    shakes hands and then trickles its request a byte at a time, are both cut at the deadline."""
    monkeypatch.setattr(serving, "METRICS_HANDSHAKE_TIMEOUT", 600.0)
    monkeypatch.setattr(serving, "METRICS_DEADLINE", 2.0)
    with metrics_server(certs.tls("metrics")) as (host, port):
        with socket.create_connection((host, port), timeout=30) as silent:
            assert closed_by_server(silent)
        with (
            socket.create_connection((host, port), timeout=30) as raw,
            scraper(certs).wrap_socket(raw, server_hostname=host) as tls,
        ):
            assert closed_by_server(tls, trickle=b"GET /metrics HTTP/1.1\r\n" + b"X" * 1000)
        assert b"# TYPE" in scrape(host, port, scraper(certs))


def test_connections_beyond_the_cap_are_closed_at_once_and_the_rest_served(certs: Certs, monkeypatch) -> None:
    monkeypatch.setattr(serving, "METRICS_HANDSHAKE_TIMEOUT", 600.0)
    monkeypatch.setattr(serving, "METRICS_CONNECTIONS", 3)
    with metrics_server(certs.tls("metrics")) as (host, port):
        held = [socket.create_connection((host, port), timeout=30) for _ in range(3)]
        try:
            with socket.create_connection((host, port), timeout=30) as extra:
                assert closed_by_server(extra)  # (the handshake bound is 600 s: closed for the cap)
        finally:
            for s in held:
                s.close()

        def answered() -> bool:
            try:
                return b"# TYPE" in scrape(host, port, scraper(certs))
            except (OSError, http.client.HTTPException):
                return False  # (the held ones' slots not yet given back)

        wait_until_sync(answered, 30)


async def test_a_broker_serves_metrics_over_tls_with_its_certificate(brokers, certs: Certs) -> None:
    import asyncio

    bs = await brokers(tls=certs.tls("broker"), metrics_listen="auto", metrics_tls=True)
    b = await bs.add_broker("zone-a")
    host, port = b.metrics_endpoint.rsplit(":", 1)
    body = await asyncio.to_thread(scrape, host, int(port), scraper(certs))
    assert b"tidings_journals" in body
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        await asyncio.to_thread(scrape, host, int(port), None)
    async with bs.client() as c:
        (member,) = (await c.members()).members
    assert member.spec.metrics_endpoint == f"https://{b.metrics_endpoint}"  # (announced: scrape it with https)
