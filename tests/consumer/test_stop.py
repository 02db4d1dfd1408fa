"""A shard stops when told (DESIGN.md invariant 8): its open transaction commits at its next chunk
and nothing more is consumed (what was read ahead is not: the checkpoint says where the next primary
starts), however large the backlog; a new primary never waits without bound for the old one to stop,
nor runs beside it, so effects land exactly once across spec changes and an unassign that gives the
shard straight back to its process.

The operator's case: raising a source's `min_offset` to skip a poisoned range restarts the primary
under the new spec, and the old primary must not go on to consume exactly that range. Real etcd and
brokers; shards in this process (the Consumer, or serve_primary)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

from tests.consumer.test_service import downstream, produce, shard
from tests.support.apps import Relay, seen
from tests.support.consumers import PRIMARY, WORDS, counts
from tests.support.waiting import wait_until
from tidings.client import AppendService
from tidings.client._base import CHUNK
from tidings.consumer import Shard, serve_primary
from tidings.consumer import replica as consumer_replica
from tidings.consumer.client import ShardClient
from tidings.message import Publisher
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.specs import shard_from_dict

BACKLOG, BATCH = 60_000, 1000


def backlog_spec(min_offset: int = 0, max_txn_duration: str = "1s") -> pb.ShardSpec:
    return shard_from_dict(
        {
            "id": "relay/0",
            "sources": [{"journal": "relay/in", "min_offset": min_offset}],
            "max_txn_duration": max_txn_duration,
        }
    )


async def publish_backlog(cluster) -> list[int]:
    """BACKLOG messages {"id": "m<i>"} to relay/in; the offset each batch of BATCH begins at."""
    begins = []
    async with cluster.client() as c:
        pub = Publisher(AppendService(c))
        for at in range(0, BACKLOG, BATCH):
            spans = await (await pub.publish_committed("relay/in", *({"id": f"m{i}"} for i in range(at, at + BATCH))))
            begins.append(spans[0].begin)
        await pub.service.aclose()
    return begins


class Counting(Relay):
    """Records each consumed message's offset; calls `at(n)` once n messages were consumed (it may
    return an awaitable: the consumption waits for it, as a slow application would)."""

    def __init__(self, at=None, n: int = BATCH) -> None:
        super().__init__()
        self.offsets: list[int] = []
        self.at, self.n = at, n

    async def consume_message(self, shard, store, envelope, publisher) -> None:
        await super().consume_message(shard, store, envelope, publisher)
        self.offsets.append(envelope.begin)
        if len(self.offsets) == self.n and self.at is not None:
            waited = self.at(self.n)
            if waited is not None:
                await waited


# A transaction closes between chunks (of at most CHUNK bytes, a message cut at a chunk's end completing
# in the next): a stop lets the open transaction finish its chunk, and a message here is > 40 bytes.
SLACK_BYTES = 2 * CHUNK
SLACK_MESSAGES = SLACK_BYTES // 40


async def test_a_stopped_primary_with_a_backlog_consumes_no_further_chunk(cluster, tmp_path) -> None:
    await cluster.create_journal("relay/in", 1)
    await publish_backlog(cluster)
    stop = asyncio.Event()
    app = Counting(at=lambda n: stop.set())
    async with cluster.client() as c:
        shard = Shard(backlog_spec(), c, data_dir=tmp_path)
        await asyncio.wait_for(serve_primary(c, shard.spec, app, stop, shard), 60)
    consumed = len(app.offsets)
    assert BATCH <= consumed < BATCH + SLACK_MESSAGES, f"{consumed} of {BACKLOG} consumed after the stop at {BATCH}"
    # What was consumed committed, and nothing else: the store and the progress agree.
    assert len(seen(tmp_path / "relay%2F0.db")) == consumed
    assert shard.read_through["relay/in"] > app.offsets[-1]


async def test_raising_min_offset_skips_the_range_the_old_primary_had_not_reached(cluster, consumers) -> None:
    await cluster.create_journal("relay/in", 1)
    begins = await publish_backlog(cluster)
    skip_to = begins[50]  # the operator skips messages BATCH*1 .. BATCH*50 ("poisoned")
    reached, go_on = asyncio.Event(), asyncio.Event()

    def hold(n: int):
        reached.set()
        return go_on.wait()  # (the old primary is mid-transaction while the spec changes)

    app = Counting(at=hold)
    a = await consumers.add("zone-a", app=app)
    async with ShardClient(a.endpoint) as sc:
        await sc.apply([pb.ShardApplyRequest.Change(upsert=backlog_spec())])
        await asyncio.wait_for(reached.wait(), 60)
        # The spec change restarts the primary (the apply returns once this process saw it).
        await sc.apply([pb.ShardApplyRequest.Change(upsert=backlog_spec(min_offset=skip_to), expect_mod_revision=-1)])
        go_on.set()
        async with cluster.client() as c:
            head = await c.write_head("relay/in")
        await sc.stat("relay/0", {"relay/in": head}, timeout=60)
    skipped = [b for b in app.offsets if app.offsets[BATCH - 1] + SLACK_BYTES < b < skip_to]
    assert not skipped, f"{len(skipped)} messages of the skipped range were consumed (first at {skipped[0]})"
    assert sorted(app.offsets)[-1] >= begins[-1]  # the new primary read on from min_offset to the end


async def test_a_new_primary_does_not_wait_for_an_old_one_stuck_in_the_application(
    cluster, consumers, monkeypatch
) -> None:
    monkeypatch.setattr(consumer_replica, "STOP_TIMEOUT", 1.0)
    await cluster.create_journal("relay/in", 1)
    await publish_backlog(cluster)
    stuck = asyncio.Event()
    app = Counting(at=lambda n: (stuck.set(), asyncio.Event().wait())[1])  # never returns
    a = await consumers.add("zone-a", app=app)
    async with ShardClient(a.endpoint) as sc:
        await sc.apply([pb.ShardApplyRequest.Change(upsert=backlog_spec())])
        await asyncio.wait_for(stuck.wait(), 60)
        app.at = None  # (the next primary consumes normally)
        await sc.apply(
            [pb.ShardApplyRequest.Change(upsert=backlog_spec(max_txn_duration="2s"), expect_mod_revision=-1)]
        )
        async with cluster.client() as c:
            head = await c.write_head("relay/in")
        resp = await sc.stat("relay/0", {"relay/in": head}, timeout=60)
    assert resp.read_through["relay/in"] >= head
    await wait_until(lambda: consumers.statuses("relay/0") == {"zone-a/c0": pb.ReplicaStatus.PRIMARY}, 10)


async def test_a_primary_whose_output_refuses_appends_still_stops_and_is_replaced(
    cluster, consumers, monkeypatch
) -> None:
    """An output journal that cannot take appends (more replicas than brokers: they are retried for
    as long as the shard lives) holds the open transaction's commit; a spec change pointing the shard
    elsewhere still replaces its primary within the stop timeout, and the process still stops."""
    from tests.consumer.test_commit_barrier import outputs, publish_ids, relay_spec
    from tidings.protocol.specs import spec_from_dict

    monkeypatch.setattr(consumer_replica, "STOP_TIMEOUT", 1.0)
    await cluster.create_journal("relay/in", 1)
    await cluster.create_journal("relay/out", 1)
    async with cluster.client() as c:  # five replicas wanted, three brokers: INSUFFICIENT_JOURNAL_BROKERS
        await c.apply([pb.ApplyRequest.Change(upsert=spec_from_dict({"name": "relay/stuck", "replication": 5}))])
    await publish_ids(cluster, ["m0"])
    app = Counting(n=1)
    reached = asyncio.Event()
    app.at = lambda n: reached.set()
    a = await consumers.add("zone-a", app=app)
    async with ShardClient(a.endpoint) as sc:
        await sc.apply([pb.ShardApplyRequest.Change(upsert=relay_spec("uncommitted", 0, out="relay/stuck"))])
        await asyncio.wait_for(reached.wait(), 30)
        fixed = relay_spec("uncommitted", 0, out="relay/out")
        await sc.apply([pb.ShardApplyRequest.Change(upsert=fixed, expect_mod_revision=-1)])

        async def m0_out() -> bool:
            return await outputs(cluster) == {"m0": 1}

        await wait_until(m0_out, 30, interval=0.1)
    await asyncio.wait_for(a.stop(graceful=False), 30)


class OneAtATime(Counting):
    """Counts the stores open at once (one per primary: never two in one process), and, while `stuck`,
    holds in consume_message and takes `unwind` seconds to give up when cancelled."""

    def __init__(self, unwind: float) -> None:
        super().__init__()
        self.open = self.most = 0
        self.unwind = unwind
        self.stuck = True
        self.holding = asyncio.Event()
        self.unwinding = asyncio.Event()  # a primary was cancelled and is letting go

    def new_store(self, shard):
        store = super().new_store(shard)
        self.open += 1
        self.most = max(self.most, self.open)
        destroy = store.destroy

        def destroyed() -> None:
            self.open -= 1
            destroy()

        store.destroy = destroyed
        return store

    async def consume_message(self, shard, store, envelope, publisher) -> None:
        await super().consume_message(shard, store, envelope, publisher)
        if self.stuck:
            self.holding.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.unwinding.set()
                await asyncio.sleep(self.unwind)  # (an application slow to let go: the thing under test)
                raise


async def test_quick_spec_changes_never_run_two_primaries_at_once(cluster, consumers, monkeypatch) -> None:
    """Two spec changes, the second as the first's old primary unwinds (stuck in the application,
    slow to let go once cancelled): each new primary waits until the one before it has ended."""
    monkeypatch.setattr(consumer_replica, "STOP_TIMEOUT", 1.0)
    await cluster.create_journal("relay/in", 1)
    await publish_backlog(cluster)
    app = OneAtATime(unwind=1.5)
    a = await consumers.add("zone-a", app=app)
    async with ShardClient(a.endpoint) as sc:
        await sc.apply([pb.ShardApplyRequest.Change(upsert=backlog_spec())])
        await asyncio.wait_for(app.holding.wait(), 30)
        app.stuck = False
        for duration in ("2s", "3s"):
            await sc.apply(
                [pb.ShardApplyRequest.Change(upsert=backlog_spec(max_txn_duration=duration), expect_mod_revision=-1)]
            )
            # (the second change comes while the first restart still waits for the unwinding primary)
            await asyncio.wait_for(app.unwinding.wait(), 30)
        async with cluster.client() as c:
            head = await c.write_head("relay/in")
        await sc.stat("relay/0", {"relay/in": head}, timeout=60)
    assert app.most == 1


async def test_a_shard_unassigned_and_assigned_back_never_runs_two_primaries_at_once(cluster, consumers) -> None:
    await cluster.create_journal("relay/in", 1)
    await publish_backlog(cluster)
    app = OneAtATime(unwind=0.0)
    app.stuck = False
    a = await consumers.add("zone-a", app=app)
    async with ShardClient(a.endpoint) as sc:
        await sc.apply([pb.ShardApplyRequest.Change(upsert=backlog_spec())])
        await wait_until(lambda: len(app.offsets) > BATCH, 30)
        assert await sc.unassign(["relay/0"]) == ["relay/0"]  # (the allocator gives it back to this process)
        async with cluster.client() as c:
            head = await c.write_head("relay/in")
        await sc.stat("relay/0", {"relay/in": head}, timeout=60)
    assert app.most == 1


async def test_unassign_and_reassign_while_busy_is_exactly_once(cluster, consumers) -> None:
    """`shards unassign` of a busy shard on its only process: the replica is closed (its open
    transaction commits) while the allocator assigns the shard to the same process again at once, so
    the next primary starts in that process on the same SQLite file. Its effects still land exactly
    once, and the shard comes back PRIMARY."""
    await cluster.create_journal("wc/in/0", 1)
    await cluster.create_journal("wc/out/0", 1)
    a = await consumers.add("zone-a")
    rng = random.Random(29)
    words = [rng.choice(WORDS) for _ in range(600)]
    async with ShardClient(a.endpoint) as sc:
        await sc.apply([pb.ShardApplyRequest.Change(upsert=shard(0, max_txn_duration="1s"))])
        await wait_until(lambda: consumers.statuses("wc/0") == {"zone-a/c0": PRIMARY}, 30)
        producing = asyncio.ensure_future(produce(cluster, "wc/in/0", words))
        for _ in range(3):
            await wait_until(lambda: consumers.statuses("wc/0") == {"zone-a/c0": PRIMARY}, 30)
            assert await sc.unassign(["wc/0"]) == ["wc/0"]
        await producing
        await wait_until(lambda: consumers.statuses("wc/0") == {"zone-a/c0": PRIMARY}, 30)
        async with cluster.client() as c:
            head = await c.write_head("wc/in/0")
        await sc.stat("wc/0", {"wc/in/0": head})
    assert counts(consumers.data_dir / "wc%2F0.db") == Counter(words)
    expected = {w: list(range(1, n + 1)) for w, n in Counter(words).items()}
    assert await downstream(cluster, "wc/out/0") == expected
