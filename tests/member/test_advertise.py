"""Addresses for real networks (member/serving.py `advertised`): a process announces the address other
hosts dial (--advertise, or its --listen address), never a wildcard nobody can dial (refused in one
line), for its gRPC service, its replication port and its metrics alike; IPv6 literals in brackets,
announced in their shortest form (certificates are checked against it).
Real etcd and brokers."""

from __future__ import annotations

import pytest

from tests.support.tcp_gate import TcpGate
from tidings.cluster.etcd import free_port
from tidings.member.serving import advertised
from tidings.protocol.status import UsageError


@pytest.mark.parametrize(
    ("bound", "advertise", "announced"),
    [
        ("127.0.0.1:8080", "", "127.0.0.1:8080"),
        ("0.0.0.0:8080", "10.0.0.5", "10.0.0.5:8080"),
        ("0.0.0.0:8080", "broker-1.example:443", "broker-1.example:443"),
        ("[::]:8080", "[fd00::5]", "[fd00::5]:8080"),
        ("[::]:8080", "[fd00::5]:9", "[fd00::5]:9"),
        ("[::1]:8080", "", "[::1]:8080"),
        ("[0:0:0:0:0:0:0:1]:8080", "", "[::1]:8080"),  # (in its shortest form: what certificates are checked as)
        ("[::]:8080", "[fd7d:0f65::11]", "[fd7d:f65::11]:8080"),
        ("[::]:8080", "[::ffff:a00:5]", "[::ffff:10.0.0.5]:8080"),  # (IPv4-mapped: as gRPC prints it)
    ],
)
def test_the_announced_address(bound: str, advertise: str, announced: str) -> None:
    assert advertised(bound, advertise, "broker b0") == announced


@pytest.mark.parametrize(
    ("bound", "advertise", "says"),
    [
        ("0.0.0.0:8080", "", "listens on 0.0.0.0:8080 but would announce an address nobody can dial: pass --advertise"),
        ("[::]:8080", "", "listens on [::]:8080 but would announce an address nobody can dial"),
        ("0.0.0.0:8080", "fd00::5", "'fd00::5' is not HOST, HOST:PORT or [IPv6]:PORT (an IPv6 literal in brackets)"),
        ("0.0.0.0:8080", "host:", "'host:' is not HOST"),
        ("0.0.0.0:8080", "0.0.0.0", "--advertise 0.0.0.0 is not an address others can dial"),
        ("[::]:8080", "[::]:9090", "--advertise [::]:9090 is not an address others can dial"),
        ("[0:0::0]:8080", "", "listens on [::]:8080 but would announce an address nobody can dial"),
        ("[::]:8080", "[0::0]", "--advertise [0::0] is not an address others can dial"),
        ("0.0.0.0:8080", "10.0.0.5:0", "--advertise 10.0.0.5:0 is not an address others can dial"),
        ("0.0.0.0:8080", "[fd00::5", "'[fd00::5' is not HOST, HOST:PORT or [IPv6]:PORT"),
        ("0.0.0.0:8080", "[nothex]:80", "'[nothex]:80' is not HOST, HOST:PORT or [IPv6]:PORT"),
        ("0.0.0.0:8080", "[fd00::5]:", "'[fd00::5]:' is not HOST, HOST:PORT or [IPv6]:PORT"),
        ("0.0.0.0:8080", "b1.example:99999", "'b1.example:99999' is not HOST, HOST:PORT or [IPv6]:PORT"),
        ("0.0.0.0:8080", "b1.example:\u00b2", "is not HOST, HOST:PORT or [IPv6]:PORT"),
    ],
)
def test_an_address_nobody_can_dial_is_refused_in_one_line(bound: str, advertise: str, says: str) -> None:
    with pytest.raises(UsageError, match="broker b0") as refused:
        advertised(bound, advertise, "broker b0")
    assert says in str(refused.value) and "\n" not in str(refused.value)


async def test_a_broker_on_a_wildcard_without_an_advertised_address_is_refused(brokers) -> None:
    """(One listening on a wildcard with --advertise, on hosts of its own: tests/member/test_hosts.py.)"""
    brokers = await brokers()
    with pytest.raises(UsageError, match="pass --advertise"):
        await brokers.add_broker("zone-a", listen="0.0.0.0:0")


async def test_a_broker_serves_on_ipv6(brokers) -> None:
    brokers = await brokers()
    b = await brokers.add_broker("zone-a", listen="[::1]:0", metrics_listen="auto")
    assert b.endpoint.startswith("[::1]:")
    await brokers.create_journal("v6/j", 1)
    async with brokers.client() as c:
        await c.append("v6/j", b"over ::1")
        assert await c.write_head("v6/j") == len(b"over ::1")
        (m,) = (await c.members()).members
        assert m.spec.replication_endpoint.startswith("[::1]:") and m.spec.metrics_endpoint.startswith("[::1]:"), m.spec


async def test_an_address_its_flag_named_is_announced_as_named(brokers) -> None:
    brokers = await brokers()
    await brokers.add_broker("zone-a", advertise="localhost", replication_listen="127.0.0.1:0", metrics_listen="auto")
    async with brokers.client() as c:
        (m,) = (await c.members()).members
    assert m.spec.endpoint.startswith("localhost:") and m.spec.metrics_endpoint.startswith("localhost:")
    assert m.spec.replication_endpoint.startswith("127.0.0.1:"), m.spec  # (--replication-listen's, as given)


async def test_replication_and_metrics_are_announced_at_the_addresses_their_flags_name(brokers) -> None:
    """--replication-advertise (a port mapped in front of the replication port: here a forwarder) is
    where peers dial; --metrics-advertise is what the member spec says to scrape."""
    brokers = await brokers()
    gates = [await TcpGate().open() for _ in range(2)]
    try:
        for i, gate in enumerate(gates):
            b = await brokers.add_broker(
                f"zone-{'ab'[i]}",
                replication_advertise=gate.endpoint,
                metrics_listen="auto",
                metrics_advertise=f"metrics-{i}.example:9100",
            )
            gate.aim(b.replication.endpoint)
        async with brokers.client() as c:
            specs = sorted((m.spec for m in (await c.members()).members), key=lambda s: s.metrics_endpoint)
            assert [(s.replication_endpoint, s.metrics_endpoint) for s in specs] == [
                (gates[0].endpoint, "metrics-0.example:9100"),
                (gates[1].endpoint, "metrics-1.example:9100"),
            ]
            await brokers.create_journal("mapped/j", 2)
            await c.append("mapped/j", b"through the mapped port")
            assert await c.write_head("mapped/j") == len(b"through the mapped port")
        assert sum(g.connections for g in gates) >= 1  # (the primary dialled its peer's announced address)
    finally:
        for gate in gates:
            await gate.shut()


async def test_a_replication_name_its_certificate_does_not_cover_is_refused_at_start(brokers, certs) -> None:
    """Peers verify the replication port's certificate for the name announced: a name of its own
    (--replication-advertise) is checked at start, as --advertise's is, before the broker joins."""
    port = free_port()
    flags = {"replication_listen": f"127.0.0.1:{port}", "replication_advertise": f"localhost:{port}"}
    narrow = await brokers(tls=certs.tls("narrow", "127.0.0.1"))  # (its certificate: 127.0.0.1 alone)
    with pytest.raises(UsageError, match=rf"cannot serve TLS at localhost:{port}: its certificate: .*mismatch"):
        await narrow.add_broker("zone-a", **flags)
    wide = await brokers(tls=certs.tls("wide"))  # (127.0.0.1, ::1 and localhost)
    b = await wide.add_broker("zone-a", **flags)
    async with wide.client() as c:
        (m,) = (await c.members()).members
    assert m.spec.replication_endpoint == f"localhost:{port}" and m.spec.endpoint == b.endpoint


def test_a_port_drawn_for_a_server_is_never_handed_out_twice() -> None:
    """Twenty targets draw their ports before any of them listens: free_port must not give two the same
    one (each is free when drawn, so only the process can remember what it gave)."""
    ports = [free_port() for _ in range(2000)]
    assert len(set(ports)) == len(ports)
