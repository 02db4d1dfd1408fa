"""The client against real brokers: routing, retries, refusals, Appender, Reader, sync facade."""

from __future__ import annotations

import asyncio
import inspect

import pytest

import tidings.client
from tests.support.fragments import write_foreign_fragment
from tests.support.waiting import wait_until
from tidings.broker import _metrics as broker_metrics
from tidings.client import AsyncClient, Client, RouteCache
from tidings.fragment.store import store_for
from tidings.protocol import labels
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.specs import spec_from_dict
from tidings.protocol.status import (
    JournalNotFoundError,
    NotAllowedError,
    RegisterMismatchError,
    StatusError,
    TransportError,
    WrongAppendOffsetError,
)


def _status_count(rpc: str, status: str) -> float:
    return broker_metrics.RPC_STATUS.labels(rpc, status)._value.get()


def test_exported_members_are_sorted_and_named_for_the_package() -> None:
    names = tidings.client.__all__
    assert names == sorted(names)
    for name in names:
        assert getattr(tidings.client, name).__module__ == "tidings.client"


def test_sync_client_has_the_async_clients_methods() -> None:
    def public(cls: type) -> set[str]:
        return {n for n, _ in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")}

    assert public(AsyncClient) - {"aclose", "backoff", "stub"} == public(Client) - {"close", "run", "iterate"}


def test_route_cache_prefers_primary_for_appends_and_own_zone_for_reads() -> None:
    cache = RouteCache("default:1", zone="b")
    route = pb.Route(
        members=[pb.ProcessId(zone="a", suffix="x"), pb.ProcessId(zone="b", suffix="y")],
        primary=0,
        endpoints=["a:1", "b:1"],
    )
    assert cache.append_endpoint("j") == "default:1"
    cache.update("j", pb.Header(route=route, etcd=pb.Header.Etcd(revision=10)))
    assert (cache.append_endpoint("j"), cache.read_endpoint("j")) == ("a:1", "b:1")
    older = pb.Route(members=[pb.ProcessId(zone="c", suffix="z")], primary=0, endpoints=["c:1"])
    cache.update("j", pb.Header(route=older, etcd=pb.Header.Etcd(revision=9)))
    assert cache.append_endpoint("j") == "a:1", "an older revision never replaces a newer Route"
    cache.invalidate("j")
    assert cache.read_endpoint("j") == "default:1"


def test_a_forgotten_data_port_is_learnt_again_from_a_route_at_a_known_revision() -> None:
    """A data port dropped after a failure comes back with the next answer naming it, even one at the
    revision the client already holds (a quiet cluster may see no newer one for hours)."""
    cache = RouteCache("a:1")
    route = pb.Route(members=[pb.ProcessId(zone="a", suffix="x")], primary=0, endpoints=["a:1"],
                     data_endpoints=["a:2"])  # fmt: skip
    header = pb.Header(route=route, etcd=pb.Header.Etcd(revision=10))
    cache.update("j", header)
    assert cache.data_endpoints == {"a:1": "a:2"}
    cache.forget_data_port("a:1")
    assert cache.data_endpoints == {}
    cache.update("j", header)
    assert cache.data_endpoints == {"a:1": "a:2"}


async def test_appends_go_to_the_primary_once_the_route_is_known(cluster) -> None:
    await cluster.create_journal("cl/route", 3)
    route = cluster.route("cl/route")
    primary = route.endpoints[route.primary]
    other = next(b.endpoint for b in cluster.brokers if b.endpoint != primary)
    async with AsyncClient(other, zone="zone-b") as c:
        first = await c.append("cl/route", b"one")  # proxied by `other`; the response teaches the Route
        assert c.routes.append_endpoint("cl/route") == primary
        zone_b = next(ep for m, ep in zip(route.members, route.endpoints, strict=True) if m.zone == "zone-b")
        assert c.routes.read_endpoint("cl/route") == zone_b
        second = await c.append("cl/route", b"two")
        assert (first.end, second.begin, second.end) == (3, 3, 6)
        assert await c.read_all("cl/route") == b"onetwo"


async def test_a_journal_is_described_by_its_exact_name(cluster) -> None:
    """`describe` and `spec` name one journal, not every journal a selector would match."""
    await cluster.create_journal("cl/spec", 3, labels={"app": "a"})
    await cluster.create_journal("cl/spec/more", 1)
    async with cluster.client(0) as c:
        found = await c.describe("cl/spec")
        assert found is not None and found.spec.name == "cl/spec" and found.mod_revision > 0
        assert (await c.spec("cl/spec")).replication == 3
        assert await c.describe("cl/none") is None
        with pytest.raises(JournalNotFoundError, match="journal 'cl/none'"):
            await c.spec("cl/none")


async def test_definite_refusals_raise_their_error_without_retry(cluster) -> None:
    await cluster.create_journal("cl/refuse", 3)
    async with cluster.client(0) as c:
        head = (await c.append("cl/refuse", b"abc", union_registers=labels.label_set({"owner": "a"}))).end
        before = _status_count("append", "WRONG_APPEND_OFFSET")
        with pytest.raises(WrongAppendOffsetError, match="journal 'cl/refuse': WRONG_APPEND_OFFSET") as info:
            await c.append("cl/refuse", b"x", offset=head + 7)
        assert not info.value.retriable
        assert _status_count("append", "WRONG_APPEND_OFFSET") == before + 1, "a definite refusal is not retried"
        with pytest.raises(RegisterMismatchError, match="another writer won"):
            await c.append("cl/refuse", b"x", check_registers=labels.parse_selector("owner=b"))
        with pytest.raises(JournalNotFoundError, match="journal 'cl/none'"):
            await c.append("cl/none", b"x")
        with pytest.raises(JournalNotFoundError):
            await c.read_all("cl/none")


async def test_transient_no_primary_is_retried_until_the_journal_is_assigned(cluster) -> None:
    spec = spec_from_dict({"name": "cl/fresh", "replication": 3, "fragment": {"stores": [cluster.store_url]}})
    async with cluster.client(1) as c:
        await c.apply([pb.ApplyRequest.Change(upsert=spec)])
        result = await c.append("cl/fresh", b"first")  # races the allocator: NO_JOURNAL_PRIMARY_BROKER is retried
        assert (result.begin, result.end) == (0, 5)


async def test_appends_survive_the_primary_broker_stopping(cluster) -> None:
    await cluster.create_journal("cl/failover", 3)
    await cluster.add_broker("zone-a")  # a spare, so R=3 can be restored
    async with cluster.client(1) as c:
        await c.append("cl/failover", b"before ")
        route = c.routes.route("cl/failover")
        assert route is not None
        primary = route.endpoints[route.primary]
        broker = next(b for b in cluster.brokers if b.endpoint == primary)
        await broker.stop(graceful=False)
        after = await c.append("cl/failover", b"after")
        assert c.routes.append_endpoint("cl/failover") != primary
        assert await c.read_all("cl/failover") == b"before after"
        assert after.end == 12


async def test_appender_commits_on_success_and_rolls_back_on_error(cluster) -> None:
    await cluster.create_journal("cl/appender", 3)
    async with cluster.client(0) as c:
        async with c.appender("cl/appender") as a:
            await a.write(b"hello ")
            await a.write(b"x" * 600_000)  # several chunks
        assert a.result is not None and (a.result.begin, a.result.end) == (0, 600_006)
        with pytest.raises(RuntimeError, match="changed my mind"):
            async with c.appender("cl/appender") as b:
                await b.write(b"never committed")
                raise RuntimeError("changed my mind")
        after = await c.append("cl/appender", b"!")
        assert (after.begin, after.end) == (600_006, 600_007), "the rolled-back append left no byte"
        with pytest.raises(WrongAppendOffsetError):
            async with c.appender("cl/appender", offset=5) as w:
                await w.write(b"refused")
        assert await c.read_all("cl/appender", 600_000) == b"xxxxxx!"


async def test_read_only_journal_refuses_appended_content(cluster) -> None:
    await cluster.create_journal("cl/ro", 3, flags="read-only")
    async with cluster.client(0) as c:
        with pytest.raises(NotAllowedError, match="journal 'cl/ro': NOT_ALLOWED"):
            await c.append("cl/ro", b"x")


async def test_blocking_reader_tails_and_survives_its_broker_stopping(cluster) -> None:
    await cluster.create_journal("cl/tail", 3)
    await cluster.add_broker("zone-b")
    async with cluster.client(0) as writer, cluster.client(1) as rc:
        await writer.append("cl/tail", b"a" * 10)
        reader = rc.reader("cl/tail", 0, block=True)
        got = bytearray()

        async def consume() -> None:
            async for chunk in reader:
                got.extend(chunk.content)

        task = asyncio.create_task(consume())
        await wait_until(lambda: len(got) == 10, 10)
        await writer.append("cl/tail", b"b" * 10)
        await wait_until(lambda: len(got) == 20, 10)
        serving = rc.routes.read_endpoint("cl/tail")
        await next(b for b in cluster.brokers if b.endpoint == serving).stop(graceful=False)
        await writer.append("cl/tail", b"c" * 10)
        await wait_until(lambda: len(got) == 30, 30)
        task.cancel()
        assert bytes(got) == b"a" * 10 + b"b" * 10 + b"c" * 10
        assert reader.offset == 30 and reader.jumps == []


async def test_reader_reports_offset_jumps(cluster) -> None:
    await cluster.create_journal("cl/jump", 3)
    async with cluster.client(0) as c:
        await c.append("cl/jump", b"abc")
        write_foreign_fragment(cluster, "cl/jump", 100, b"0123456789", age=7 * 3600)  # persisted long ago
        await wait_until(lambda: _index_end(cluster, "cl/jump") == 110, 20)
        seen: list[tuple[int, int]] = []
        reader = c.reader("cl/jump", 0, block=False, on_jump=lambda a, b: seen.append((a, b)))
        data = b"".join([chunk.content async for chunk in reader])
        assert data == b"abc0123456789"
        assert reader.jumps == seen == [(3, 100)]


async def test_a_read_never_skips_a_hole_that_may_still_fill(cluster) -> None:
    """Bytes past a hole whose fragment was persisted just now may be preceded by content still on its
    way (an upload racing a hand-off): readers wait at the hole instead of skipping it."""
    await cluster.create_journal("cl/hole", 3)
    async with cluster.client(0) as c:
        await c.append("cl/hole", b"abc")
        write_foreign_fragment(cluster, "cl/hole", 100, b"0123456789")  # fresh: the hole [3, 100) may fill
        await wait_until(lambda: _index_end(cluster, "cl/hole") == 110, 20)
        for i in range(3):
            async with cluster.client(i) as ci:
                reader = ci.reader("cl/hole", 0, block=False)
                assert b"".join([chunk.content async for chunk in reader]) == b"abc"
                assert reader.offset == 3 and reader.jumps == []
        blocking = c.reader("cl/hole", 0, block=True, end_offset=110)
        got = asyncio.ensure_future(_collect(blocking))
        await asyncio.sleep(0.2)
        assert not got.done(), "a blocking read waits at the hole"
        write_foreign_fragment(cluster, "cl/hole", 3, b"x" * 97)  # the missing content arrives
        assert await asyncio.wait_for(got, 30) == b"abc" + b"x" * 97 + b"0123456789"
        assert blocking.jumps == []


async def test_a_fixed_range_message_read_waits_at_a_hole_that_may_still_fill(cluster) -> None:
    """A read of [0, end) (a Spark task's) with on_jump and direct store reads waits at a
    hole whose next fragment is fresh, and delivers every message in order once it fills: it
    neither skips the hole as lost nor stops short of its end."""
    import msgspec

    from tidings.message import ReadUncommitted

    lines = [b'{"n":1}\n', b'{"n":2,"p":"' + b"x" * 77 + b'"}\n', b'{"n":3}\n']  # [0, 8), [8, 100), [100, 108)
    await cluster.create_journal("cl/hole-range", 3)
    async with cluster.client(0) as c:
        await c.append("cl/hole-range", lines[0])
        write_foreign_fragment(cluster, "cl/hole-range", 100, lines[2])  # fresh: [8, 100) may fill
        await wait_until(lambda: _index_end(cluster, "cl/hole-range") == 108, 20)
        jumps: list[tuple[str, int, int]] = []
        got: list[bytes] = []
        reader = ReadUncommitted(
            c,
            "cl/hole-range",
            end_offsets={"cl/hole-range": 108},
            message_type=msgspec.Raw,
            uuids_of=lambda values: [None] * len(values),
            direct=True,
            on_jump=lambda *jump: jumps.append(jump),
        )

        async def read() -> None:
            async for env in reader:
                got.append(bytes(env.message) + b"\n")

        task = asyncio.ensure_future(read())
        await wait_until(lambda: len(got) >= 1, 20)
        write_foreign_fragment(cluster, "cl/hole-range", 8, lines[1])  # the missing content arrives
        await asyncio.wait_for(task, 30)
        assert got == lines and jumps == []


async def _collect(reader) -> bytes:
    return b"".join([chunk.content async for chunk in reader])


def _index_end(cluster, journal: str) -> int:
    return max(b.resolver.replicas[journal].index.end_offset for b in cluster.brokers if journal in b.resolver.replicas)


async def test_reader_reads_persisted_fragments_straight_from_the_store(cluster) -> None:
    await cluster.create_journal("cl/direct", 3, fragment={"length": "1KiB"})
    async with cluster.client(0) as c:
        for i in range(6):
            await c.append("cl/direct", bytes([65 + i]) * 700)  # each append past 1 KiB rolls the fragment

        def served_from_the_store() -> bool:  # (listed, and every replica's index knows it: any may serve)
            listed = store_for(cluster.store_url).list("cl/direct")
            reps = [b.resolver.replicas["cl/direct"] for b in cluster.brokers if "cl/direct" in b.resolver.replicas]
            found = [rep.index.query(f.begin) for rep in reps for f in listed]
            return len(listed) >= 3 and all(e is not None and e[0].backing_store for e in found)

        await wait_until(served_from_the_store, 20)
        reader = c.reader("cl/direct", 0, block=False, direct=True)
        data = b"".join([chunk.content async for chunk in reader])
        assert data == b"".join(bytes([65 + i]) * 700 for i in range(6))
        assert reader.direct_reads >= 3


async def test_a_store_the_client_cannot_read_is_read_through_the_broker(cluster, monkeypatch) -> None:
    """A reader without access to the fragment store (no credentials on a Spark executor, say)
    falls back to the broker, which can read it, rather than failing."""

    await cluster.create_journal("cl/no-store", 1, fragment={"length": "1KiB"})
    async with cluster.client(0) as c:
        for i in range(4):
            await c.append("cl/no-store", bytes([65 + i]) * 700)
        await wait_until(lambda: len(store_for(cluster.store_url).list("cl/no-store")) >= 2, 20)

        def no_store(url: str):
            raise PermissionError(f"no credentials for {url}")

        monkeypatch.setattr("tidings.fragment.store.store_for", no_store)  # (what a direct read opens)
        reader = c.reader("cl/no-store", 0, block=False, direct=True)
        data = b"".join([chunk.content async for chunk in reader])
        assert data == b"".join(bytes([65 + i]) * 700 for i in range(4))
        assert reader.direct_reads == 0


async def test_a_store_fallback_whose_broker_fails_too_raises_a_tidings_error(cluster, monkeypatch) -> None:
    """The fallback's own broker read failing (the broker went away in between) is a TransportError
    the reader retries and then raises, as every other read failure: not a raw grpc.RpcError."""
    from tidings.cluster.etcd import free_port

    await cluster.create_journal("cl/no-store-no-broker", 1, fragment={"length": "1KiB"})
    async with cluster.client(0) as c:
        for i in range(2):
            await c.append("cl/no-store-no-broker", bytes([65 + i]) * 1100)

        async def listed_in_store() -> bool:
            """The first fragment persisted and known so to the broker (not as its local spool, which it
            would serve itself: the read would never ask the store)."""
            listing = await c.fragments("cl/no-store-no-broker")
            return any(e.url and e.spec.begin == 0 for e in listing.fragments)

        await wait_until(listed_in_store, 20)
    async with AsyncClient(cluster.brokers[0].endpoint, retries=1) as c:
        stub, dead = c.stub, f"127.0.0.1:{free_port()}"

        def no_store(url: str):
            c.stub = lambda endpoint: stub(dead)  # (the broker goes away too: the fallback's read fails)
            raise PermissionError(f"no credentials for {url}")

        monkeypatch.setattr("tidings.fragment.store.store_for", no_store)  # (what a direct read opens)
        reader = c.reader("cl/no-store-no-broker", 0, block=False, direct=True)
        with pytest.raises(TransportError):
            _ = [chunk async for chunk in reader]


async def test_sync_client_mirrors_the_async_one(cluster) -> None:
    await cluster.create_journal("cl/sync", 3)
    endpoint = cluster.brokers[0].endpoint

    def script() -> tuple[bytes, int, list[str]]:
        with Client(endpoint) as c:
            c.append("cl/sync", b"one ")
            with c.appender("cl/sync") as a:
                a.write(b"two")
            with pytest.raises(StatusError):
                c.append("cl/sync", b"x", offset=1)
            chunks = [chunk.content for chunk in c.read("cl/sync")]
            return b"".join(chunks), c.write_head("cl/sync"), [j.spec.name for j in c.list().journals]

    data, head, names = await asyncio.to_thread(script)
    assert (data, head) == (b"one two", 7)
    assert "cl/sync" in names


async def test_a_whole_append_cancelled_under_us_is_a_transport_error_not_our_cancellation() -> None:
    """The same for an append small enough to go as one unary call: a server that holds the call
    (the append is under way, its outcome unknown), then the client's channel goes away under it."""
    import grpc

    arrived, release = asyncio.Event(), asyncio.Event()

    async def holds(request_iterator, context) -> bytes:
        async for _ in request_iterator:
            arrived.set()
        await release.wait()
        return b""

    server = grpc.aio.server()
    handler = grpc.stream_unary_rpc_method_handler(holds)
    service = pb.DESCRIPTOR.services_by_name["Journal"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, {"Append": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with AsyncClient(f"127.0.0.1:{port}", retries=0) as c:
            appending = asyncio.ensure_future(c.append("cl/held", b"small enough for one message"))
            await asyncio.wait_for(arrived.wait(), 10)
            for ch in list(c._channels.values()):
                await ch.close()
            with pytest.raises(TransportError) as err:
                await asyncio.wait_for(appending, 10)
            assert err.value.retriable
    finally:
        release.set()
        await server.stop(0)


async def test_a_call_grpc_cancels_on_its_own_is_a_transport_error_not_our_cancellation(cluster) -> None:
    """grpc.aio cancels a call whose channel goes away under it, and the awaiting task then gets a
    CancelledError although nobody cancelled it. The client reports a retriable transport failure
    (the outcome is unknown); it must not kill its caller's task as a cancellation would."""
    await cluster.create_journal("cl/cancelled-under-us", 3)
    release, under_way = asyncio.Event(), asyncio.Event()

    async def stalls():
        yield b"part one "
        under_way.set()  # the call took the first part and asks for more
        await release.wait()
        yield b"never sent"

    async with cluster.client(0) as c:
        appending = asyncio.ensure_future(c.append("cl/cancelled-under-us", stalls()))
        await asyncio.wait_for(under_way.wait(), 10)
        for ch in list(c._channels.values()):
            await ch.close()
        with pytest.raises(TransportError) as err:
            await asyncio.wait_for(appending, 10)
        assert err.value.retriable
        release.set()
