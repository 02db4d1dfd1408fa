"""Addresses for real networks (member/serving.py `advertised`): a process announces the address other
hosts dial (--advertise, or its --listen address), never a wildcard nobody can dial (refused in one
line), for its gRPC service, its replication port and its metrics alike; IPv6 literals in brackets.
Real etcd and brokers."""

from __future__ import annotations

import pytest

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
        ("0.0.0.0:8080", "10.0.0.5:0", "--advertise 10.0.0.5:0 is not an address others can dial"),
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
