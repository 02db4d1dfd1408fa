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
from tidings.broker.transport_rpc import JOURNAL, OPEN_HEAD
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
    writer.write(HEADER.pack(len(JOURNAL.hello), 0, HELLO) + JOURNAL.hello)
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
    writer.write(HEADER.pack(len(JOURNAL.hello), 0, HELLO) + JOURNAL.hello + HEADER.pack(1, 1, OPEN) + b"\x01")
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
            return sum(len(conn.served()) for b in cluster.brokers for conn in b.replication.connections)

        task = asyncio.ensure_future(tail())
        await wait_until(lambda: calls() == 1, 10)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await wait_until(lambda: calls() == 0, 10)


def broker_calls(cluster) -> list:
    """The calls the cluster's brokers are serving on their data ports."""
    return [call for b in cluster.brokers for conn in b.replication.connections for call in conn.served()]


async def test_a_call_waiting_its_turn_never_holds_the_connection(cluster) -> None:
    """An append waiting for its journal's pipeline (another append holds it) takes no more than its window
    of the connection: the holder's content is still read and commits, and the waiter's cancellation is
    heard at once and rolls it back, although both share one connection."""
    from tests.support.waiting import wait_until
    from tidings.broker.frames import INITIAL_WINDOW

    await cluster.create_journal("wire/g", 3)
    async with AsyncClient(cluster.brokers[0].endpoint, transport="tidings") as c:
        await learned(c, "wire/g")
        holder = c.appender("wire/g")
        await holder.write(b"h" * 1024)  # (it holds the journal's pipeline until it commits)
        waiter = c.appender("wire/g")

        async def flood() -> None:
            for _ in range(40):  # 20 MiB: beyond its window and the connection's old pause limit
                await waiter.write(b"w" * (512 * 1024))

        flooding = asyncio.ensure_future(flood())
        await wait_until(lambda: any(call._grants.room <= 0 for call in broker_calls(cluster)), 20)
        assert not flooding.done()  # (its window is full: it waits for room)
        held = max(call._inbound for call in broker_calls(cluster))
        assert held <= INITIAL_WINDOW + 512 * 1024  # (a waiting call's window stays the initial one, and a message)
        waiter.abort()
        await asyncio.gather(flooding, return_exceptions=True)
        tail = os.urandom(6 * 1024 * 1024)  # more than a window: read while the waiter's bytes sat there
        await asyncio.wait_for(holder.write(tail), 30)
        done = await asyncio.wait_for(holder.commit(), 30)
        assert (done.begin, done.end) == (0, 1024 + len(tail))
        assert await c.read_all("wire/g") == b"h" * 1024 + tail
        await wait_until(lambda: not broker_calls(cluster), 10)


async def test_a_read_nobody_iterates_buffers_only_its_window(cluster) -> None:
    """A Read whose caller stops taking responses holds at most its window in the client, and the other
    calls on its connection go on meanwhile."""
    from tests.support.waiting import wait_until
    from tidings.broker.frames import CALL_WINDOW

    await cluster.create_journal("wire/h", 1)
    async with AsyncClient(cluster.brokers[0].endpoint, transport="tidings") as c:
        await learned(c, "wire/h")
        content = os.urandom(12 * 1024 * 1024)
        for at in range(0, len(content), 2 * 1024 * 1024):
            await c.append("wire/h", content[at : at + 2 * 1024 * 1024])
        reads = c.reader("wire/h", 0, block=False).__aiter__()
        first = await reads.__anext__()  # (one response taken; then nobody iterates)

        def held() -> int:
            conns = [w.channel._conn for w in c._wires.values() if w.channel._conn]
            return sum(size for conn in conns for call in conn.calls.values() for _, size in call._responses)

        def stalled() -> bool:  # (the broker has no room left to send, and what it sent waits here)
            return held() > 0 and any(call.credit.left <= 0 for call in broker_calls(cluster))

        await wait_until(stalled, 20)
        assert await c.append("wire/h", b"meanwhile") is not None  # (the connection still serves others)
        assert 0 < held() <= CALL_WINDOW + 1024 * 1024  # its window (and one message over it) at most
        rest = b"".join([chunk.content async for chunk in reads])
        assert (first.content + rest)[: len(content)] == content
        await reads.aclose()


async def test_a_data_port_that_serves_no_clients_sends_calls_over_grpc(cluster) -> None:
    """A Route announcing a data port that does not serve clients (a broker of an older version: a
    replication port only) costs one failed attempt: the client's retry goes over gRPC to the same
    broker, which is not taken for down, and the port is avoided after."""
    from tidings.broker.transport import ReplicationServer

    async def never(stream) -> None:
        raise AssertionError("no replication stream expected")

    old = await ReplicationServer(never).start("127.0.0.1:0")
    try:
        await cluster.create_journal("wire/i", 3)
        async with AsyncClient(cluster.brokers[0].endpoint, transport="tidings") as c:
            await learned(c, "wire/i")
            for ep in list(c.routes.data_endpoints):
                c.routes.data_endpoints[ep] = old.endpoint
            assert (await c.append("wire/i", b"over gRPC")).end == 9
            assert (await c.append("wire/i", b"again")).end == 14
            assert old.endpoint in c._data_down and not c._down
            assert await c.read_all("wire/i") == b"over gRPCagain"
    finally:
        await old.aclose()


async def test_a_stopping_broker_finishes_its_calls_and_refuses_new_ones(cluster) -> None:
    """While a broker stops (its grace period), the calls it serves on the data port finish and new ones are
    refused UNAVAILABLE, as its gRPC server does: the append open on it commits, the client's next call
    goes elsewhere."""
    from tests.support.waiting import wait_until
    from tidings.client._wire import WireError, WireStub
    from tidings.protocol import protocol_pb2 as pb

    await cluster.create_journal("wire/j", 3)
    broker = cluster.brokers[0]
    async with AsyncClient(broker.endpoint, transport="tidings") as c:
        await learned(c, "wire/j")
        appender = c.appender("wire/j")
        await appender.write(b"begun before the stop")
        stub = c.stub(broker.endpoint)
        assert isinstance(stub, WireStub)
        await wait_until(lambda: [call for conn in broker.replication.connections for call in conn.served()], 10)
        draining = asyncio.ensure_future(broker.replication.drain_calls(30))
        await wait_until(lambda: broker.replication.stopping, 10)
        with pytest.raises(WireError, match="stopping"):
            await stub.ListMembers(pb.MembersRequest())
        assert not draining.done()  # (the append is still being served)
        done = await appender.commit()
        assert (done.begin, done.end) == (0, len(b"begun before the stop"))
        await asyncio.wait_for(draining, 10)  # (over once its last call ended: not the whole grace)
        broker.replication.stopping = False


async def test_a_connection_whose_stream_ids_are_spent_is_replaced(cluster) -> None:
    """Stream ids are 32 bits: the call taking the last one is served, the next goes on a new connection,
    and the old one closes once its calls are over."""
    from tidings.client._wire import LAST_SID

    await cluster.create_journal("wire/k", 1)
    async with AsyncClient(cluster.brokers[0].endpoint, transport="tidings") as c:
        await learned(c, "wire/k")
        await c.append("wire/k", b"a")
        (wire,) = c._wires.values()
        old = wire.channel._conn
        assert old is not None
        old._next_sid = LAST_SID
        await c.append("wire/k", b"b")  # (the last id)
        assert old.closed is not None and wire.channel._conn is None
        await c.append("wire/k", b"c")
        assert wire.channel._conn is not None and wire.channel._conn is not old
        assert await c.read_all("wire/k") == b"abc"


async def test_a_data_port_now_of_another_broker_refuses_the_client(cluster) -> None:
    """A client's HELLO names the broker its Route put at the port: another broker found there (a stale
    endpoint) refuses the connection, and the call goes over gRPC to the broker meant."""
    await cluster.create_journal("wire/l", 3)
    first, second = cluster.brokers[0], cluster.brokers[1]
    async with AsyncClient(first.endpoint, transport="tidings") as c:
        await learned(c, "wire/l")
        port = second.replication.endpoint
        c.routes.data_members[port] = c.routes.data_members[first.replication.endpoint]  # (the port was the first's)
        for ep in list(c.routes.data_endpoints):
            c.routes.data_endpoints[ep] = port
        assert (await c.append("wire/l", b"x")).end == 1
        assert port in c._data_down and not c._down
        assert not [conn for conn in second.replication.connections if conn.calls is not None]


async def test_an_append_whose_deadline_passes_while_its_content_waits_never_commits(cluster) -> None:
    """The deadline covers the whole call, the wait for its content too: an append whose content source
    stalls past it fails DEADLINE_EXCEEDED at the deadline and rolls back, whatever the source does after
    (as over gRPC)."""
    from tidings.protocol.status import TransportError

    await cluster.create_journal("wire/m", 1)
    async with AsyncClient(cluster.brokers[0].endpoint, transport="tidings") as c:
        await learned(c, "wire/m")
        resume = asyncio.Event()

        async def late():
            yield b"a" * 10
            await resume.wait()  # (the content source stalls: past the deadline)
            yield b"b" * 10

        with pytest.raises(TransportError, match="DEADLINE_EXCEEDED"):
            await asyncio.wait_for(c.append("wire/m", late(), timeout=1.0), 20)
        resume.set()
        barrier = await c.append("wire/m", b"")  # (through the journal's pipeline: after anything of the above)
        assert barrier.end == 0 and await c.read_all("wire/m") == b""


async def test_an_appender_aborted_while_dialing_never_opens(cluster, monkeypatch) -> None:
    """abort() while the connection is still being dialed: the append is never opened on the broker (it
    would hold its journal's pipeline), and the next append goes through at once."""
    from tests.support.waiting import wait_until
    from tidings.client._wire import WireChannel

    await cluster.create_journal("wire/n", 1)
    async with AsyncClient(cluster.brokers[0].endpoint, transport="tidings") as c:
        await learned(c, "wire/n")
        for w in c._wires.values():
            if w.channel._conn is not None:
                w.channel._conn.close("the test dials again")
        dial, gate, dialing = WireChannel._dial, asyncio.Event(), asyncio.Event()

        async def held(self):
            dialing.set()
            await gate.wait()
            return await dial(self)

        monkeypatch.setattr(WireChannel, "_dial", held)
        appender = c.appender("wire/n")
        opening = asyncio.ensure_future(appender.open())
        await asyncio.wait_for(dialing.wait(), 10)
        appender.abort()
        gate.set()
        with pytest.raises(asyncio.CancelledError):  # (as an aborted gRPC call's write raises)
            await opening
        monkeypatch.setattr(WireChannel, "_dial", dial)
        assert not broker_calls(cluster)
        assert (await asyncio.wait_for(c.append("wire/n", b"next"), 5)).end == 4
        await wait_until(lambda: not broker_calls(cluster), 10)


async def test_a_client_cannot_make_a_broker_hold_more_than_its_windows(cluster) -> None:
    """Requests to a call that takes one (a List watch) close the connection; a request over the service's
    limit is refused RESOURCE_EXHAUSTED; more than MAX_CALLS calls at once close the connection. The
    broker goes on serving others."""
    from tidings.broker.frames import END, REQUEST, end_status
    from tidings.broker.transport_rpc import MAX_CALLS
    from tidings.protocol import protocol_pb2 as pb

    await cluster.create_journal("wire/o", 1)
    host, port = cluster.brokers[0].replication.endpoint.rsplit(":", 1)

    async def connect():
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(HEADER.pack(len(JOURNAL.hello), 0, HELLO) + JOURNAL.hello)
        return reader, writer

    async def closed(reader) -> bytes:
        answered = b""
        while chunk := await asyncio.wait_for(reader.read(1 << 20), 10):
            answered += chunk
        return answered

    watch = OPEN_HEAD.pack(3, 0) + pb.ListRequest(watch=True).SerializeToString()
    reader, writer = await connect()
    writer.write(HEADER.pack(len(watch), 1, OPEN) + watch + HEADER.pack(4, 1, REQUEST) + b"\x00" * 4)
    await closed(reader)  # (a request to a List: the connection ends)
    writer.close()

    reader, writer = await connect()
    big = OPEN_HEAD.pack(6, 0) + b"\x7a\x80\x80\x80\x05" + b"\x00" * (10 << 20)  # (a 10 MiB unknown field)
    writer.write(HEADER.pack(len(big), 1, OPEN) + big)
    await writer.drain()
    head = await asyncio.wait_for(reader.readexactly(HEADER.size), 10)
    while HEADER.unpack(head)[2] != END:  # (past the HELLO)
        await asyncio.wait_for(reader.readexactly(HEADER.unpack(head)[0]), 10)
        head = await asyncio.wait_for(reader.readexactly(HEADER.size), 10)
    length, sid, _ = HEADER.unpack(head)
    code, details = end_status(await reader.readexactly(length))
    assert (sid, code.name) == (1, "RESOURCE_EXHAUSTED") and "over the limit" in details
    for sid in range(2, MAX_CALLS + 3):
        writer.write(HEADER.pack(len(watch), sid, OPEN) + watch)
    await closed(reader)  # (beyond MAX_CALLS at once: the connection ends)
    writer.close()

    async with AsyncClient(cluster.brokers[0].endpoint, transport="tidings") as c:
        await learned(c, "wire/o")
        assert (await c.append("wire/o", b"served")).end == 6


async def test_calls_beyond_max_calls_wait_for_a_slot_under_their_deadline(cluster) -> None:
    """A client keeps at most MAX_CALLS calls on a connection: one more waits for a slot (within its
    deadline), and a slot freed by a reset call is taken at once without the broker counting the reset
    call still (it would close the connection)."""
    from tidings.broker.transport_rpc import MAX_CALLS
    from tidings.client._wire import WireError, WireStub
    from tidings.protocol import protocol_pb2 as pb

    await cluster.create_journal("wire/p", 1)
    async with AsyncClient(cluster.brokers[0].endpoint, transport="tidings") as c:
        await learned(c, "wire/p")
        stub = c.stub(cluster.brokers[0].endpoint)
        assert isinstance(stub, WireStub)
        watches = [stub.List(pb.ListRequest(watch=True)).__aiter__() for _ in range(MAX_CALLS)]
        await asyncio.gather(*(w.__anext__() for w in watches))  # (all open: each had its first answer)
        with pytest.raises(WireError, match="DEADLINE_EXCEEDED"):
            await stub.ListMembers(pb.MembersRequest(), timeout=0.5)
        await watches[0].aclose()  # (RESET: its slot is free)
        another = stub.List(pb.ListRequest(watch=True)).__aiter__()
        await asyncio.wait_for(another.__anext__(), 10)
        conn = stub.channel._conn
        assert conn is not None and conn.closed is None and len(conn.calls) == MAX_CALLS
        for w in [*watches[1:], another]:
            await w.aclose()
        assert (await c.append("wire/p", b"x")).end == 1


async def test_a_data_port_that_never_says_hello_sends_calls_over_grpc(cluster) -> None:
    """A data port that accepts connections and says nothing (another service now on the port) is given
    up after CONNECT_TIMEOUT: the call goes over gRPC."""
    silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    try:
        await cluster.create_journal("wire/q", 1)
        async with AsyncClient(cluster.brokers[0].endpoint, transport="tidings") as c:
            await learned(c, "wire/q")
            for ep in list(c.routes.data_endpoints):
                c.routes.data_endpoints[ep] = f"127.0.0.1:{port}"
            assert (await asyncio.wait_for(c.append("wire/q", b"over gRPC"), 30)).end == 9
            assert f"127.0.0.1:{port}" in c._data_down
    finally:
        silent.close()


async def test_a_client_that_reads_nothing_it_is_sent_is_dropped(cluster, monkeypatch) -> None:
    """A client that sends and never reads (a frozen process, or a flood of PINGs) stops being read once
    what the broker has to send it piles up, and its connection is dropped after CLIENT_STALL."""
    from tests.support.waiting import wait_until
    from tidings.broker import transport
    from tidings.broker.frames import PING

    monkeypatch.setattr(transport, "CLIENT_STALL", 0.5)
    broker = cluster.brokers[0]
    host, port = broker.replication.endpoint.rsplit(":", 1)
    before = set(broker.replication.connections)
    _reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(HEADER.pack(len(JOURNAL.hello), 0, HELLO) + JOURNAL.hello)
    ping = HEADER.pack(0, 0, PING)
    for _ in range(40):
        writer.write(ping * 50_000)  # (2M PINGs: their PONGs are far over the broker's write buffer)
    flooding = asyncio.ensure_future(writer.drain())
    mine = await wait_until(lambda: [c for c in broker.replication.connections if c not in before], 10)
    await wait_until(lambda: mine[0].closed is not None, 20)
    assert "read nothing" in mine[0].closed
    await asyncio.gather(flooding, return_exceptions=True)  # (reset by the broker)
    writer.close()


def test_a_served_call_may_send_a_whole_window_after_its_first_grant() -> None:
    """Once a call's receiver consumes (its append holds the pipeline), the sender has the whole call
    window: a 1 MiB append's four 256 KiB chunks follow the first without waiting for a round trip each."""
    from tidings.broker.frames import CALL_WINDOW, Credit, Grants

    credit, grants = Credit(), Grants()
    chunk = 256 * 1024
    assert grants.received(chunk)  # the first chunk (a message may overdraw the initial window)
    credit.left -= chunk
    credit.grant(grants.consumed(chunk))  # the handler took it: one WINDOW back
    for _ in range(3):
        assert credit.left > 0, "the sender would wait a round trip for this chunk"
        assert grants.received(chunk)
        credit.left -= chunk
    assert credit.left == grants.room == CALL_WINDOW - 3 * chunk  # (both ends agree on the room left)
