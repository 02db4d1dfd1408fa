"""Clients' calls on a broker's data port (`transport="tidings"`: client/_wire.py, broker/transport_rpc.py)
keep every guarantee the gRPC service gives: appends all or nothing (a cancelled streamed append rolls
back), reads of exactly the committed bytes, the same statuses, the same capability checks under TLS and
tokens; garbage on the port ends only its own connection. Real in-process brokers over the session etcd."""

from __future__ import annotations

import asyncio
import os

import pytest

from tests.support.auth import token
from tidings.auth import BearerAuthorizer, KeySet, generate_key
from tidings.broker.frames import HEADER, HELLO, OPEN
from tidings.broker.transport_rpc import CLIENT_HELLO, OPEN_HEAD
from tidings.client import AsyncClient
from tidings.protocol.claims import Capability
from tidings.protocol.status import JournalNotFoundError, PermissionDeniedError


def on_the_wire(c: AsyncClient) -> int:
    """How many calls the client made on data ports (none: it used gRPC throughout)."""
    return sum(max(0, (w.channel._conn._next_sid - 1) if w.channel._conn else 0) for w in c._wires.values())


async def learned(c: AsyncClient, journal: str) -> None:
    """Let the client learn the journal's Route (and with it the data ports)."""
    await c.write_head(journal)
    assert c.routes.data_endpoints, "no Route announced a data port"


async def test_appends_reads_and_listings_on_the_data_port(cluster) -> None:
    await cluster.create_journal("wire/a", 3)
    async with AsyncClient(cluster.brokers[0].endpoint, transport="tidings") as c:
        await learned(c, "wire/a")
        small = await c.append("wire/a", b"one\n")
        big = os.urandom(3 * 1024 * 1024)  # (streamed: over one chunk)
        streamed = await c.append("wire/a", big)
        assert (small.begin, small.end, streamed.begin, streamed.end) == (0, 4, 4, 4 + len(big))
        read = b"".join([chunk.content async for chunk in c.reader("wire/a", 0, block=False)])
        assert read == b"one\n" + big
        assert [j.spec.name for j in (await c.list()).journals] == ["wire/a"]
        assert (await c.fragments("wire/a")).fragments
        assert on_the_wire(c) >= 5


async def test_a_cancelled_streamed_append_on_the_data_port_rolls_back(cluster) -> None:
    await cluster.create_journal("wire/b", 3)
    async with AsyncClient(cluster.brokers[0].endpoint, transport="tidings") as c:
        await learned(c, "wire/b")
        appender = c.appender("wire/b")
        await appender.open()
        await appender.write(b"never committed " * 1000)
        appender.abort()
        after = await c.append("wire/b", b"kept")
        assert (after.begin, after.end) == (0, 4)
        read = b"".join([chunk.content async for chunk in c.reader("wire/b", 0, block=False)])
        assert read == b"kept"


async def test_statuses_on_the_data_port_are_the_services(cluster) -> None:
    await cluster.create_journal("wire/c", 3)
    async with AsyncClient(cluster.brokers[0].endpoint, transport="tidings", retries=0) as c:
        await learned(c, "wire/c")
        with pytest.raises(JournalNotFoundError):
            await c.append("wire/missing", b"x")
        with pytest.raises(Exception, match="offset"):
            await c.append("wire/c", b"x", offset=12345)
        assert await c.write_head("wire/c") == 0  # (nothing written)


async def test_tokens_and_tls_are_checked_on_the_data_port_as_on_grpc(brokers, certs) -> None:
    keys = generate_key()
    bs = await brokers(tls=certs.tls("broker"), auth_keys=KeySet.parse(keys))
    for zone in ("zone-a", "zone-b", "zone-c"):
        await bs.add_broker(zone)
    await bs.create_journal("wire/mine", 3, labels={"app": "a"})
    await bs.create_journal("wire/theirs", 3, labels={"app": "b"})
    client_tls = certs.tls("wire-client", server=False)
    key = KeySet.parse(keys).signing_key
    scoped = BearerAuthorizer(token(Capability.APPEND | Capability.READ | Capability.LIST, "app=a", key=key))
    async with AsyncClient(bs.brokers[0].endpoint, tls=client_tls, auth=scoped, transport="tidings", retries=0) as c:
        await learned(c, "wire/mine")
        await c.append("wire/mine", b"ok")
        with pytest.raises((JournalNotFoundError, PermissionDeniedError)):
            await c.append("wire/theirs", b"no")
        assert [j.spec.name for j in (await c.list()).journals] == ["wire/mine"]
        assert on_the_wire(c) >= 2
    reader = BearerAuthorizer(token(Capability.READ | Capability.LIST, "", key=key))
    async with AsyncClient(bs.brokers[0].endpoint, tls=client_tls, auth=reader, transport="tidings", retries=0) as c:
        await learned(c, "wire/mine")
        with pytest.raises(PermissionDeniedError):
            await c.append("wire/mine", b"no")
        assert on_the_wire(c) >= 1
    async with bs.client() as c:
        assert await c.write_head("wire/theirs") == 0
        assert await c.write_head("wire/mine") == 2


async def test_an_appender_whose_data_port_is_gone_fails_instead_of_waiting(cluster) -> None:
    """A Route naming a data port nothing listens on any more (a broker restarted elsewhere): opening an
    append there fails UNAVAILABLE at once, and the client's calls to that broker go over gRPC after."""
    from tidings.cluster.etcd import free_port
    from tidings.protocol.status import TransportError

    await cluster.create_journal("wire/e", 3)
    async with AsyncClient(cluster.brokers[0].endpoint, transport="tidings") as c:
        await learned(c, "wire/e")
        for ep in list(c.routes.data_endpoints):
            c.routes.data_endpoints[ep] = f"127.0.0.1:{free_port()}"
        appender = c.appender("wire/e")
        with pytest.raises(TransportError, match="UNAVAILABLE"):
            await asyncio.wait_for(appender.open(), 20)
        assert (await c.append("wire/e", b"over gRPC")).end == 9


async def test_garbage_after_a_client_hello_ends_that_connection_only(cluster) -> None:
    await cluster.create_journal("wire/d", 1)
    host, port = cluster.brokers[0].replication.endpoint.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(HEADER.pack(len(CLIENT_HELLO), 0, HELLO) + CLIENT_HELLO)
    unknown = OPEN_HEAD.pack(99, 0)
    writer.write(HEADER.pack(len(unknown), 1, OPEN) + unknown)  # an unknown method: UNIMPLEMENTED, served on
    bad = OPEN_HEAD.pack(1, 0) + b"\xff\xff\xff"
    writer.write(HEADER.pack(len(bad), 3, OPEN) + bad)  # a message that does not parse: the connection ends
    await writer.drain()
    answered = b""
    while chunk := await asyncio.wait_for(reader.read(65536), 10):
        answered += chunk
    writer.close()
    assert b"no method 99" in answered
    reader, writer = await asyncio.open_connection(host, int(port))  # an OPEN too short to say anything
    writer.write(HEADER.pack(len(CLIENT_HELLO), 0, HELLO) + CLIENT_HELLO + HEADER.pack(1, 1, OPEN) + b"\x01")
    await writer.drain()
    while await asyncio.wait_for(reader.read(65536), 10):
        pass
    writer.close()
    async with AsyncClient(cluster.brokers[0].endpoint, transport="tidings") as c:
        await learned(c, "wire/d")
        await c.append("wire/d", b"still serving")
        assert on_the_wire(c) >= 1


async def test_a_watch_given_up_by_its_caller_ends_on_the_broker_too(cluster) -> None:
    """A caller that stops waiting on a watched List (its task cancelled, as a closed JournalList's is)
    ends the call on the broker as well: no handler is left serving nobody."""
    from tests.support.waiting import wait_until

    await cluster.create_journal("wire/f", 3)
    async with AsyncClient(cluster.brokers[0].endpoint, transport="tidings") as c:
        await learned(c, "wire/f")

        async def tail() -> None:
            async for _ in c.watch():
                pass

        def calls() -> int:
            return sum(len(conn.calls or {}) for b in cluster.brokers for conn in b.replication.connections)

        task = asyncio.ensure_future(tail())
        await wait_until(lambda: calls() == 1, 10)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await wait_until(lambda: calls() == 0, 10)
