"""Publisher, mappings and message iterators against real brokers (DESIGN.md invariant 7)."""

from __future__ import annotations

import asyncio
import uuid

import msgspec
import pytest

from tests.message.test_framing import BytesEvent
from tests.support.waiting import wait_until
from tidings.client import AppendService, Client
from tidings.message import (
    ACK_TXN,
    CONTINUE_TXN,
    OUTSIDE_TXN,
    JournalList,
    Publisher,
    get_flags,
    modulo_mapping,
    new_acknowledgement,
    random_mapping,
    read_committed,
    read_uncommitted,
    rendezvous_mapping,
)
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.specs import spec_from_dict
from tidings.protocol.status import NotAllowedError, UsageError

NDJSON_LABELS = {"content-type": "application/x-ndjson"}


class Order(msgspec.Struct):
    id: int = 0
    item: str = ""
    uuid: uuid.UUID | None = None


class Strict(msgspec.Struct):
    id: int
    uuid: uuid.UUID | None = None


async def _committed(client, journals, **options) -> list:
    return [env async for env in read_committed(client, journals, block=False, **options)]


async def test_committed_messages_read_once_despite_duplicate_appends(cluster) -> None:
    await cluster.create_journal("msg/orders", 3, labels=NDJSON_LABELS)
    async with cluster.client(0) as c:
        pub = Publisher(AppendService(c))
        done = await pub.publish_committed("msg/orders", *({"id": i} for i in range(100)))
        spans = await done
        raw = await c.read_all("msg/orders")
        await c.append("msg/orders", raw)  # the whole batch again: an at-least-once retry
        got = await _committed(c, "msg/orders")
        every = [env async for env in read_uncommitted(c, "msg/orders", block=False)]
    assert [e.message["id"] for e in got] == list(range(100))
    assert len(every) == 200, "read-uncommitted sees the duplicates"
    assert all(get_flags(e.uuid) == OUTSIDE_TXN for e in got)
    assert spans[0].end == len(raw)


async def test_transaction_is_delivered_at_its_ack_and_rolled_back_by_older_intents(cluster) -> None:
    await cluster.create_journal("msg/txn-a", 3, labels=NDJSON_LABELS)
    await cluster.create_journal("msg/txn-b", 3, labels=NDJSON_LABELS)
    async with cluster.client(0) as c:
        pub = Publisher(AppendService(c))
        await (await pub.publish_uncommitted("msg/txn-a", {"n": 1}, {"n": 2}))
        await (await pub.publish_uncommitted("msg/txn-b", {"n": 3}))
        assert await _committed(c, ["msg/txn-a", "msg/txn-b"]) == [], "pending until acknowledged"
        intents = pub.build_ack_intents()
        assert sorted(i.journal for i in intents) == ["msg/txn-a", "msg/txn-b"]
        await (await pub.write_ack_intents(intents))
        got = await _committed(c, ["msg/txn-a", "msg/txn-b"])
        assert sorted(e.message["n"] for e in got) == [1, 2, 3]
        # A second transaction, abandoned: re-writing the first transaction's intents rolls it back.
        await (await pub.publish_uncommitted("msg/txn-a", {"n": 4}))
        await (await pub.write_ack_intents(intents))
        await (await pub.publish_committed("msg/txn-a", {"n": 5}))
        got = await _committed(c, ["msg/txn-a", "msg/txn-b"])
        assert sorted(e.message["n"] for e in got) == [1, 2, 3, 5]
        flags = sorted({get_flags(e.uuid) async for e in _aiter(read_uncommitted(c, "msg/txn-a", block=False))})
        assert flags == [OUTSIDE_TXN, CONTINUE_TXN, ACK_TXN]


async def _aiter(it):
    async for x in it:
        yield x


async def test_struct_and_protobuf_messages_round_trip(cluster) -> None:
    await cluster.create_journal("msg/structs", 3, labels=NDJSON_LABELS)
    await cluster.create_journal("msg/protos", 3, labels={"content-type": "application/x-protobuf-fixed"})
    async with cluster.client(0) as c:
        pub = Publisher(AppendService(c))
        await (await pub.publish_uncommitted("msg/structs", Order(1, "apple"), Order(2, "pear")))
        await (await pub.publish_uncommitted("msg/protos", BytesEvent(body="hello")))
        await (await pub.write_ack_intents(pub.build_ack_intents()))
        orders = await _committed(c, "msg/structs", message_type=Order)
        protos = await _committed(c, "msg/protos", message_type=BytesEvent)
    assert [(o.message.id, o.message.item) for o in orders] == [(1, "apple"), (2, "pear")]
    assert all(isinstance(o.message.uuid, uuid.UUID) for o in orders)
    assert [p.message.body for p in protos] == ["hello"]
    with pytest.raises(UsageError, match="new_acknowledgement"):
        new_acknowledgement(Strict, "msg/structs")


async def test_mappings_pick_journals_of_a_selector_and_follow_the_list(cluster) -> None:
    for i in range(3):
        await cluster.create_journal(f"msg/part-{i}", 1, labels={**NDJSON_LABELS, "topic": "clicks"})
    async with cluster.client(0) as c:
        journals = await JournalList(c, "topic=clicks").start()
        assert journals.names == ["msg/part-0", "msg/part-1", "msg/part-2"]
        by_mod = modulo_mapping(journals, lambda m: m["user"])
        by_hash = rendezvous_mapping(journals, lambda m: m["user"])
        users = [{"user": f"u{i}"} for i in range(300)]
        before = [by_hash(u) for u in users]
        assert [by_mod(u) for u in users] == [by_mod(u) for u in users], "a key always maps to one journal"
        assert len(set(before)) == 3 and len({by_mod(u) for u in users}) == 3
        assert {random_mapping(journals)(u) for u in users} == set(journals.names)
        await cluster.create_journal("msg/part-3", 1, labels={**NDJSON_LABELS, "topic": "clicks"})
        await wait_until(lambda: len(journals.names) == 4, 10)
        after = [by_hash(u) for u in users]
        moved = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
        assert moved and all(b == "msg/part-3" for _a, b in moved), "rendezvous moves keys only to the new journal"
        assert len(moved) < 150
        pub = Publisher(AppendService(c), journals=journals)
        await (await pub.publish_committed(by_hash, *users))
        got = await _committed(c, journals.names)
        await journals.aclose()
    assert sorted(e.message["user"] for e in got) == sorted(u["user"] for u in users)
    assert all(e.journal == by_hash(e.message) for e in got)
    with pytest.raises(UsageError, match="no journal matches"):
        modulo_mapping(JournalList(c, "topic=none"), lambda m: "k")({})


async def test_undecodable_lines_and_invalid_uuids_are_reported_and_skipped(cluster) -> None:
    await cluster.create_journal("msg/bad", 3, labels=NDJSON_LABELS)
    async with cluster.client(0) as c:
        pub = Publisher(AppendService(c))
        await (await pub.publish_committed("msg/bad", {"n": 1}))
        bad = await c.append("msg/bad", b'{"n": 2, "oops\n{"n": 3, "uuid": "not-a-uuid"}\n')
        await (await pub.publish_committed("msg/bad", {"n": 4}))
        reported = []
        reader = read_committed(c, "msg/bad", block=False, on_garbage=lambda j, g: reported.append((j, g.begin)))
        got = [e.message["n"] async for e in reader]
    assert got == [1, 4]
    assert reader.garbage == 2
    first_line_end = bad.begin + len(b'{"n": 2, "oops\n')
    assert reported == [("msg/bad", bad.begin), ("msg/bad", first_line_end)]


async def test_message_larger_than_a_chunk_still_appends(cluster) -> None:
    await cluster.create_journal("msg/big", 3, labels=NDJSON_LABELS)
    async with cluster.client(0) as c:
        pub = Publisher(AppendService(c))
        blob = "x" * (5 << 20)  # larger than the broker's largest chunk (4 MiB)
        await (await pub.publish_committed("msg/big", {"blob": blob}, {"blob": "small"}))
        got = await _committed(c, "msg/big")
    assert [len(e.message["blob"]) for e in got] == [5 << 20, 5]


async def test_checkpoint_resumes_a_committed_reader_without_loss_or_duplicates(cluster) -> None:
    await cluster.create_journal("msg/resume", 3, labels=NDJSON_LABELS)
    async with cluster.client(0) as c:
        pub = Publisher(AppendService(c))
        await (await pub.publish_uncommitted("msg/resume", *({"n": i} for i in range(10))))
        await (await pub.write_ack_intents(pub.build_ack_intents()))
        await (await pub.publish_uncommitted("msg/resume", *({"n": i} for i in range(10, 15))))
        first = read_committed(c, "msg/resume", block=False)
        seen = []
        async for env in first:
            seen.append(env.message["n"])
            if len(seen) == 4:
                break
        checkpoint = first.checkpoint()
        await (await pub.write_ack_intents(pub.build_ack_intents()))
        resumed = await _committed(c, "msg/resume", checkpoint=checkpoint)
    assert seen + [e.message["n"] for e in resumed] == list(range(15))


async def test_sync_iteration_with_a_sync_client(cluster) -> None:
    await cluster.create_journal("msg/sync", 3, labels=NDJSON_LABELS)
    async with cluster.client(0) as c:
        pub = Publisher(AppendService(c))
        await (await pub.publish_committed("msg/sync", *({"n": i} for i in range(5))))

    def read() -> list[int]:
        with Client(cluster.brokers[0].endpoint) as sc:
            return [env.message["n"] for env in read_committed(sc, "msg/sync", block=False)]

    assert await asyncio.to_thread(read) == list(range(5))
    with pytest.raises(UsageError, match="async for"):
        iter(read_committed(c, "msg/sync"))


async def test_messages_that_cannot_carry_a_uuid_are_refused_with_a_hint(cluster) -> None:
    class Bare(msgspec.Struct):
        n: int

    await cluster.create_journal("msg/bare", 3, labels=NDJSON_LABELS)
    async with cluster.client(0) as c:
        pub = Publisher(AppendService(c))
        with pytest.raises(TypeError, match="__tidings_no_uuid__"):
            await pub.publish_committed("msg/bare", Bare(1))
        assert await c.read_all("msg/bare") == b"", "nothing of a refused publish is written"


async def test_batches_yield_the_same_messages_a_list_at_a_time(cluster) -> None:
    await cluster.create_journal("msg/batches", 3, labels=NDJSON_LABELS)
    async with cluster.client(0) as c:
        pub = Publisher(AppendService(c))
        for start in range(0, 3000, 500):
            await (await pub.publish_uncommitted("msg/batches", *({"n": i} for i in range(start, start + 500))))
            await (await pub.write_ack_intents(pub.build_ack_intents()))
        reader = read_committed(c, "msg/batches", block=False)
        lists = [batch async for batch in reader.batches()]
        resumed = await _committed(c, "msg/batches", checkpoint=reader.checkpoint())
    assert [e.message["n"] for batch in lists for e in batch] == list(range(3000))
    assert resumed == [], "a checkpoint after the last list holds everything"


async def test_stopping_early_over_several_journals_leaves_no_reader_behind(cluster) -> None:
    for name in ("msg/early-a", "msg/early-b"):
        await cluster.create_journal(name, 1, labels=NDJSON_LABELS)
    async with cluster.client(0) as c:
        pub = Publisher(AppendService(c, batch_bytes=4096))
        for name in ("msg/early-a", "msg/early-b"):
            for start in range(0, 20_000, 1000):  # many small appends: more chunks than the reader's queue holds
                await pub.publish_committed(name, *({"n": i} for i in range(start, start + 1000)))
        await pub.service.aclose()
        reader = read_committed(c, ["msg/early-a", "msg/early-b"], block=False)
        it = reader.batches()
        first = await anext(it)
        await asyncio.wait_for(it.aclose(), 10)  # the journals' pumps stop even with a full queue
        assert first and not [t for t in asyncio.all_tasks() if t.get_name().startswith("read:msg/early")]


async def test_an_ack_is_never_committed_before_the_messages_it_acknowledges(cluster) -> None:
    """Invariant 7 across journals: a transaction's ACK in one journal waits until its messages in
    every other journal have committed (here one has no quorum, R=4 on three brokers, for a while)."""
    stuck = spec_from_dict(
        {"name": "msg/stuck", "replication": 4, "labels": NDJSON_LABELS, "fragment": {"stores": [cluster.store_url]}}
    )
    await cluster.create_journal("msg/quick", 3, labels=NDJSON_LABELS)
    await cluster.create_journal("msg/other", 3, labels=NDJSON_LABELS)
    async with cluster.client(0) as c:
        await c.apply([pb.ApplyRequest.Change(upsert=stuck)])
        svc = AppendService(c)
        pub = Publisher(svc)
        slow = await pub.publish_uncommitted("msg/stuck", {"n": 1})
        await (await pub.publish_uncommitted("msg/quick", {"n": 2}))
        acks = await pub.write_ack_intents(pub.build_ack_intents())
        await wait_until(lambda: svc.statistics().retries >= 3, 20)
        await (await pub.publish_committed("msg/other", {"n": 3}))  # other journals go on meanwhile
        flags = [get_flags(e.uuid) async for e in _aiter(read_uncommitted(c, "msg/quick", block=False))]
        assert flags == [CONTINUE_TXN], "no ACK in msg/quick while its transaction's message in msg/stuck waits"
        assert await _committed(c, "msg/quick") == []
        await cluster.add_broker("zone-a")
        await slow
        await acks
        got = await _committed(c, ["msg/stuck", "msg/quick"])
        await svc.aclose()
    assert sorted(e.message["n"] for e in got) == [1, 2]


async def test_an_ack_is_not_written_when_a_message_of_its_transaction_failed(cluster) -> None:
    """Atomicity: a message append of the transaction was refused, so no journal gets the ACK, and
    the messages that did commit stay pending (read-committed readers never see them)."""
    from tidings.client import DependencyFailedError, EarlierAppendFailedError

    await cluster.create_journal("msg/ok", 3, labels=NDJSON_LABELS)
    await cluster.create_journal("msg/ro", 3, labels=NDJSON_LABELS, flags="read-only")
    async with cluster.client(0) as c:
        pub = Publisher(AppendService(c))
        ok = await pub.publish_uncommitted("msg/ok", {"n": 1})
        bad = await pub.publish_uncommitted("msg/ro", {"n": 2})
        await ok
        with pytest.raises(NotAllowedError):
            await bad
        acks = await pub.write_ack_intents(pub.build_ack_intents())
        with pytest.raises((DependencyFailedError, EarlierAppendFailedError)):
            await acks
        await pub.service.aclose()
        flags = [get_flags(e.uuid) async for e in _aiter(read_uncommitted(c, "msg/ok", block=False))]
        assert flags == [CONTINUE_TXN], "the ACK was not written"
        assert await _committed(c, ["msg/ok", "msg/ro"]) == []


async def test_a_long_transaction_of_single_message_publishes_stays_linear(cluster, monkeypatch) -> None:
    """A consumer publishes a message at a time, thousands per transaction, faster than appends commit:
    the Publisher's forgetting of committed appends must not rescan every pending one per publish
    (it did: 37M checks for 50k messages, a consumer shard's whole time)."""
    from tidings.message import publisher as publisher_module

    await cluster.create_journal("pub/long", 3, labels=NDJSON_LABELS)
    checks = 0
    committed = publisher_module._committed

    def counting(fut):
        nonlocal checks
        checks += 1
        return committed(fut)

    monkeypatch.setattr(publisher_module, "_committed", counting)
    async with cluster.client() as c:
        pub = Publisher(AppendService(c))
        n = 4000
        futures = [await pub.publish_uncommitted("pub/long", {"i": i}) for i in range(n)]
        assert checks <= 4 * n, checks
        await (await pub.write_ack_intents(pub.build_ack_intents()))
        assert len(await asyncio.gather(*futures)) == n
        await pub.service.aclose()
        assert [env.message["i"] for env in await _committed(c, "pub/long")] == list(range(n))


async def test_a_single_appends_future_is_listed_as_gather_would() -> None:
    """The one-journal publish returns `_listed(append)` instead of `gather(append)` (half the cost per
    message): the same result, failure and cancellation."""
    from tidings.message.publisher import _listed

    loop = asyncio.get_running_loop()
    ok, bad, gone = loop.create_future(), loop.create_future(), loop.create_future()
    listed = [_listed(f) for f in (ok, bad, gone)]
    ok.set_result("span")
    bad.set_exception(NotAllowedError("refused"))
    gone.cancel()
    assert await listed[0] == ["span"]
    with pytest.raises(NotAllowedError, match="refused"):
        await listed[1]
    with pytest.raises(asyncio.CancelledError):
        await listed[2]
    waiting = loop.create_future()
    _listed(waiting).cancel()  # (the caller stops waiting; the append itself goes on)
    assert not waiting.cancelled()
