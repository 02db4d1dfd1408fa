"""A new primary reads on from where its checkpoint says, as in Gazette, and every source message
takes effect once (DESIGN.md invariant 8): a source producer that began a transaction and never
acknowledged it (a dead producer, a Spark sink's failed task attempt) does not pin where every later
primary starts reading (its transaction is re-read only if its ACK ever comes); a source's raised
`min_offset` moves the start past a range even when the checkpoint knows the journal; and an upstream
transaction spanning many of the shard's transactions is replayed exactly once through crashes. Real
etcd and brokers; shards in this process."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

from tests.consumer.test_shard import (
    COUNTS,
    WordCount,
    check_downstream,
    crash_at_random_points,
    produce,
    read_through,
    spec,
    stored_counts,
)
from tests.support.apps import Relay, seen
from tests.support.waiting import wait_until
from tidings.client import AppendService
from tidings.consumer import Shard, SQLiteStore, serve_primary
from tidings.message import Publisher, read_uncommitted
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.specs import shard_from_dict

SPEC = shard_from_dict({"id": "relay/0", "sources": ["relay/in"], "max_txn_duration": "1s"})


class Watching(Relay):
    def __init__(self) -> None:
        super().__init__()
        self.garbage: list[tuple[str, int]] = []

    def on_garbage(self, shard, journal, garbage) -> None:
        self.garbage.append((journal, garbage.begin))


async def serve_until_read(c, tmp_path, app, head: int) -> Shard:
    stop = asyncio.Event()
    shard = Shard(SPEC, c, data_dir=tmp_path)
    task = asyncio.ensure_future(serve_primary(c, SPEC, app, stop, shard))
    try:
        await wait_until(lambda: task.done() or shard.read_through.get("relay/in", 0) >= head, 30)
    finally:
        stop.set()
        await asyncio.wait([task])
    task.result()
    return shard


async def test_a_producer_that_never_acknowledges_does_not_pin_where_a_new_primary_reads(cluster, tmp_path) -> None:
    await cluster.create_journal("relay/in", 1)
    async with cluster.client() as c:
        dead = Publisher(AppendService(c))  # begins a transaction, never acknowledges it
        await (await dead.publish_uncommitted("relay/in", {"id": "never"}))
        await c.append("relay/in", b"not json\n")
        live = Publisher(AppendService(c))
        await (await live.publish_committed("relay/in", *({"id": f"m{i}"} for i in range(5))))
        head = await c.write_head("relay/in")
        app = Watching()
        await serve_until_read(c, tmp_path, app, head)
        assert [g[0] for g in app.garbage] == ["relay/in"]
        # The next primaries start at the read-through offset, past the garbage and the dead transaction.
        for i in range(2):
            await (await live.publish_committed("relay/in", {"id": f"later{i}"}))
            await serve_until_read(c, tmp_path, app, await c.write_head("relay/in"))
        assert len(app.garbage) == 1, app.garbage
        # The dead transaction still commits if its ACK ever comes (re-read then, from where it began).
        await (await dead.write_ack_intents(dead.build_ack_intents()))
        await serve_until_read(c, tmp_path, app, await c.write_head("relay/in"))
        await dead.service.aclose()
        await live.service.aclose()
    expected = {"never": 1, **{f"m{i}": 1 for i in range(5)}, "later0": 1, "later1": 1}
    assert seen(tmp_path / "relay%2F0.db") == expected


async def test_a_recovered_ack_intent_of_a_deleted_journal_is_discarded_and_the_others_written(
    cluster, etcd_root, tmp_path
) -> None:
    """A primary dies between its store commit and its ACKs (SIGKILL right after the commit); one of
    its two output journals is then deleted. The next primary discards that journal's recovered ACK
    intent (one log line naming shard, journal and why), writes the other, and serves on: the
    transaction's messages in the remaining journal commit, and no operator is needed."""
    from tests.consumer.test_commit_barrier import outputs, publish_ids, relay_spec
    from tests.support.consumer_procs import ConsumerProcs
    from tidings.consumer.client import ShardClient
    from tidings.protocol import protocol_pb2 as pb

    for name in ("relay/in", "relay/out", "relay/side"):
        await cluster.create_journal(name, 1)
    await publish_ids(cluster, ["m0", "m1", "m2"])
    procs = ConsumerProcs(cluster, etcd_root + "-consumer", tmp_path, "tests.support.apps:Relay")
    try:
        first = await procs.start("c0", "zone-a", env={"TIDINGS_TEST_KILL_AFTER_COMMIT": "1"})
        async with ShardClient(first) as sc:
            spec = relay_spec("uncommitted", 0, side="relay/side")
            await sc.apply([pb.ShardApplyRequest.Change(upsert=spec)])
        assert await procs.wait_exit("c0", 60) == -9, procs.log("c0")[-3000:]
        assert await outputs(cluster) == {}  # (its ACKs were never written)
        async with cluster.client() as c:
            revision = {j.spec.name: j.mod_revision for j in (await c.list()).journals}["relay/side"]
            await c.apply([pb.ApplyRequest.Change(delete="relay/side", expect_mod_revision=revision)])
        second = await procs.start("c1", "zone-b")

        async def committed() -> bool:
            return await outputs(cluster) == {"m0": 1, "m1": 1, "m2": 1}

        await wait_until(committed, 30, interval=0.1)

        async def primary() -> bool:  # (its status reaches etcd after its store is restored, on its own time)
            async with ShardClient(second) as sc:
                shards = (await sc.list()).shards
            return [st.code for st in shards[0].status] == [pb.ReplicaStatus.PRIMARY]

        await wait_until(primary, 30, interval=0.1)
        assert "discarding the recovered ACK intent of output journal relay/side" in procs.log("c1")
        # Once the journal is back, the shard serves on (nothing to unassign). (Over a fresh store: the old
        # one may hold the deleted journal's fragments, which a journal created again over them refuses
        # appends for, until `journals reset-head`.)
        await cluster.create_journal("relay/side", 1, fragment={"stores": [f"file://{tmp_path / 'side-store'}/"]})
        await publish_ids(cluster, ["m3"])
        await wait_until(lambda: seen(tmp_path / "shards" / "relay%2F0.db").get("m3") == 1, 30)
    finally:
        procs.stop_all()


async def test_a_raised_min_offset_skips_what_lies_below_it(cluster, tmp_path) -> None:
    """ShardSpec.Source.min_offset lower-bounds where a source is read, as Gazette's startReadingMessages
    does (`if offset < src.MinOffset { offset = src.MinOffset }`), also when the checkpoint already has
    the journal: an operator raises it to skip a range (bad data, history not wanted), and nothing of
    that range is consumed."""
    for name in ("wc/in", "wc/out"):
        await cluster.create_journal(name, 3)
    path = tmp_path / "wc-0.db"
    setup = SQLiteStore(path)  # (the counts table, before anyone polls it)
    setup.db.execute(COUNTS)
    setup.destroy()
    await produce(cluster, ["apple"] * 5)
    async with cluster.client() as c:
        stop = asyncio.Event()
        task = asyncio.ensure_future(serve_primary(c, spec(), WordCount(path), stop))
        await wait_until(lambda: stored_counts(path) == {"apple": 5}, 20)
        stop.set()
        await task
        await produce(cluster, ["poison"] * 5)  # the range the operator skips
        head = [env.end async for env in read_uncommitted(c, "wc/in", block=False)][-1]
        await produce(cluster, ["banana"] * 5)
        raised = spec()
        raised.sources[0].min_offset = head
        stop = asyncio.Event()
        task = asyncio.ensure_future(serve_primary(c, raised, WordCount(path), stop))
        await wait_until(lambda: stored_counts(path).get("banana") == 5 or task.done(), 20)
        stop.set()
        await asyncio.wait([task])
    assert stored_counts(path) == Counter(apple=5, banana=5)


WORDS = ["apple", "banana", "cherry", "date"]


def small_ring_spec() -> pb.ShardSpec:
    return pb.ShardSpec(
        id="wc/0",
        sources=[pb.ShardSpec.Source(journal="wc/in")],
        max_txn_duration_ms=100,
        min_txn_duration_ms=0,
        ring_buffer_size=4,
    )


async def produce_interleaved(cluster, rng: random.Random, words: list[str], path) -> None:
    """Producer A's one transaction (60 words in 12 appends), producer B's committed words between;
    after each of B's appends, until a shard transaction read through it and committed, so that A's
    transaction spans twelve of the shard's."""
    async with cluster.client() as c:
        a, b = Publisher(AppendService(c)), Publisher(AppendService(c))
        for _ in range(12):
            batch = [rng.choice(WORDS) for _ in range(5)]
            words.extend(batch)
            await (await a.publish_uncommitted("wc/in", *({"word": w} for w in batch)))
            mine = [rng.choice(WORDS) for _ in range(3)]
            words.extend(mine)
            end = (await (await b.publish_committed("wc/in", *({"word": w} for w in mine))))[-1].end
            await wait_until(lambda end=end: read_through(path) >= end, 30)
        await (await a.write_ack_intents(a.build_ack_intents()))
        tail = [rng.choice(WORDS) for _ in range(5)]
        words.extend(tail)
        await (await b.publish_committed("wc/in", *({"word": w} for w in tail)))
        await a.service.aclose()
        await b.service.aclose()


async def test_an_upstream_transaction_spanning_many_shard_transactions_through_crashes(cluster, tmp_path) -> None:
    """A source journal whose upstream transaction spans many of the shard's transactions (its messages
    interleaved with another producer's committed ones), a small Sequencer ring (the commit is
    replayed), and the shard crashed (cancelled) at points across it: every word counts exactly once,
    downstream running counts once each in order."""
    for name in ("wc/in", "wc/out"):
        await cluster.create_journal(name, 3)
    rng = random.Random(28)
    words: list[str] = []
    path = tmp_path / "wc-0.db"
    async with cluster.client() as c:
        stop = asyncio.Event()
        task = asyncio.ensure_future(serve_primary(c, small_ring_spec(), WordCount(path), stop))
        await produce_interleaved(cluster, rng, words, path)  # (paced by the running shard's commits)
        stop.set()
        await task
        await crash_at_random_points(c, small_ring_spec(), path, rng, 4, 3, 40)  # (through A's replayed commit)
        stop = asyncio.Event()
        task = asyncio.ensure_future(serve_primary(c, small_ring_spec(), WordCount(path), stop))
        try:
            await wait_until(lambda: sum(stored_counts(path).values()) >= len(words) or task.done(), 30)
        finally:
            stop.set()
            await asyncio.wait([task])
        if task.exception() is not None:
            raise task.exception()
    assert stored_counts(path) == Counter(words)
    await check_downstream(cluster, Counter(words))
