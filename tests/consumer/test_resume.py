"""A new primary reads on from its checkpoint's read-through offsets, as in Gazette: a source
producer that began a transaction and never acknowledged it (a dead producer, a Spark sink's failed
task attempt) does not pin where every later primary starts reading (its transaction is re-read only
if its ACK ever comes). Real etcd and brokers; shards in this process."""

from __future__ import annotations

import asyncio

from tests.support.apps import Relay, seen
from tests.support.waiting import wait_until
from tidings.client import AppendService
from tidings.consumer.shard import Shard, serve_primary
from tidings.message import Publisher
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
        async with ShardClient(second) as sc:
            shards = (await sc.list()).shards
        assert [st.code for st in shards[0].status] == [pb.ReplicaStatus.PRIMARY], shards[0].status
        assert "discarding the recovered ACK intent of output journal relay/side" in procs.log("c1")
        # Once the journal is back, the shard serves on (nothing to unassign). (Over a fresh store: the old
        # one may hold the deleted journal's fragments, which a journal created again over them refuses
        # appends for, until `journals reset-head`.)
        await cluster.create_journal("relay/side", 1, fragment={"stores": [f"file://{tmp_path / 'side-store'}/"]})
        await publish_ids(cluster, ["m3"])
        await wait_until(lambda: seen(tmp_path / "shards" / "relay%2F0.db").get("m3") == 1, 30)
    finally:
        procs.stop_all()
