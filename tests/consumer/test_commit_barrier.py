"""A shard's store commit waits for every append its transaction made, whichever API made it
(DESIGN.md invariant 10; gazette-exactly-once.txt: "any published messages B, derived from A, will
be read exactly once by any downstream read-committed reader"), and a definite failure of any of
them fails the transaction instead of committing it; a failure of the ACKs written after the commit
fails the shard too, even with no more input.

The application publishes through each path docs/shards.md offers: the hook's `publisher`
(uncommitted or committed), `shard.publisher` (from `consume_message`, or `begin_txn`, which can
reach no other). Outputs of megabytes keep the appends in flight while the transaction commits.
Real etcd and brokers; the kill test runs `tidings consumer` processes, one killing itself (SIGKILL)
right after its first store commit resolves, the way a crash there would."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from tests.consumer.test_shard import WordCount, produce, spec
from tests.support.apps import SEEN, Relay, seen
from tests.support.consumer_procs import ConsumerProcs
from tests.support.waiting import wait_until
from tidings.client import AppendService
from tidings.consumer import Shard, SQLiteStore, serve_primary
from tidings.consumer.client import ShardClient
from tidings.message import Publisher, read_committed
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.specs import shard_from_dict

MODES = ["uncommitted", "committed", "shard-uncommitted", "shard-committed", "begin"]
AT_LEAST_ONCE = {"committed", "shard-committed"}  # committed at once: a transaction run again publishes again
PAD = 4 << 20


def relay_spec(mode: str, pad: int = PAD, **labels: str) -> pb.ShardSpec:
    return shard_from_dict(
        {
            "id": "relay/0",
            "sources": ["relay/in"],
            "max_txn_duration": "2s",
            "min_txn_duration": "0s",
            "labels": {"mode": mode, "out": "relay/out", "pad": str(pad), **labels},
        }
    )


async def publish_ids(cluster, ids: list[str]) -> None:
    async with cluster.client() as c:
        pub = Publisher(AppendService(c))
        await (await pub.publish_committed("relay/in", *({"id": i} for i in ids)))
        await pub.service.aclose()


async def outputs(cluster, journal: str = "relay/out") -> Counter:
    """Ids read committed from `journal` (begin_txn's markers left out)."""
    got: Counter = Counter()
    async with cluster.client() as c:
        async for env in read_committed(c, journal, block=False):
            if not env.message["id"].startswith("begin:"):
                got[env.message["id"]] += 1
    return got


def check_outputs(mode: str, got: Counter, ids: list[str]) -> None:
    if mode in AT_LEAST_ONCE:
        assert set(got) == set(ids), got
    else:
        assert got == Counter(ids), got


class Watched(Relay):
    """A Relay noting, as each store commit resolves, which of the appends made before it are still in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight_at_commit: list[int] = []

    async def finished_txn(self, shard, store, commit: asyncio.Future) -> None:
        made = list(self.appended)

        def committed(c: asyncio.Future) -> None:
            if not c.cancelled() and c.exception() is None:
                self.in_flight_at_commit.append(sum(not f.done() for f in made))

        commit.add_done_callback(committed)


@pytest.mark.parametrize("mode", MODES)
async def test_the_store_commit_waits_for_every_append_of_its_transaction(cluster, tmp_path, mode) -> None:
    await cluster.create_journal("relay/in", 1)
    await cluster.create_journal("relay/out", 1)
    ids = [f"m{i}" for i in range(3)]
    await publish_ids(cluster, ids)
    app = Watched()
    async with cluster.client() as c:
        stop = asyncio.Event()
        shard = Shard(relay_spec(mode), c, data_dir=tmp_path)
        task = asyncio.ensure_future(serve_primary(c, shard.spec, app, stop, shard))
        try:
            await wait_until(lambda: task.done() or shard.read_through.get("relay/in", 0) > 0, 60)
        finally:
            stop.set()
            await asyncio.wait([task])
        task.result()
    assert app.in_flight_at_commit and not any(app.in_flight_at_commit), app.in_flight_at_commit
    check_outputs(mode, await outputs(cluster), ids)
    assert seen(tmp_path / "relay%2F0.db") == dict.fromkeys(ids, 1)


@pytest.mark.parametrize("mode", ["committed", "shard-uncommitted"])
async def test_outputs_survive_a_kill_right_after_the_store_commit(cluster, etcd_root, tmp_path, mode) -> None:
    await cluster.create_journal("relay/in", 3)
    await cluster.create_journal("relay/out", 3)
    ids = [f"m{i}" for i in range(3)]
    await publish_ids(cluster, ids)
    procs = ConsumerProcs(cluster, etcd_root + "-consumer", tmp_path, "tests.support.apps:Relay")
    try:
        first = await procs.start("c0", "zone-a", env={"TIDINGS_TEST_KILL_AFTER_COMMIT": "1"})
        async with ShardClient(first) as sc:
            await sc.apply([pb.ShardApplyRequest.Change(upsert=relay_spec(mode, 8 << 20))])
        assert await procs.wait_exit("c0", 120) == -9, procs.log("c0")[-3000:]
        await procs.start("c1", "zone-b")

        async def all_out() -> bool:
            return set(await outputs(cluster)) >= set(ids)

        try:
            await wait_until(all_out, 60, interval=0.2)
        except AssertionError:
            raise AssertionError(f"outputs after the kill: {await outputs(cluster)} of {ids}") from None
        check_outputs(mode, await outputs(cluster), ids)
    finally:
        procs.stop_all()
    assert seen(tmp_path / "shards" / "relay%2F0.db") == dict.fromkeys(ids, 1)


class DeletesSide(Relay):
    """Deletes its side output journal once the first transaction committed (an operator, at that moment)."""

    def __init__(self, client) -> None:
        super().__init__()
        self.client, self.deleted = client, asyncio.Event()

    def new_store(self, shard) -> SQLiteStore:
        return SQLiteStore(shard.path(), schema=[SEEN])

    async def finished_txn(self, shard, store, commit) -> None:
        await commit
        if not self.deleted.is_set():
            revision = {j.spec.name: j.mod_revision for j in (await self.client.list()).journals}["relay/side"]
            await self.client.apply([pb.ApplyRequest.Change(delete="relay/side", expect_mod_revision=revision)])
            self.deleted.set()


@pytest.mark.parametrize("mode", ["committed", "shard-uncommitted"])
async def test_a_failed_append_fails_its_transaction_and_names_the_output(cluster, consumers, mode) -> None:
    for name in ("relay/in", "relay/out", "relay/side"):
        await cluster.create_journal(name, 1)
    await publish_ids(cluster, ["m0"])
    async with cluster.client() as c:
        app = DeletesSide(c)
        a = await consumers.add("zone-a", app=app)
        async with ShardClient(a.endpoint) as sc:
            await sc.apply([pb.ShardApplyRequest.Change(upsert=relay_spec(mode, 0, side="relay/side"))])
            await wait_until(app.deleted.is_set, 30)
            await publish_ids(cluster, ["m1"])  # its output to relay/side cannot be written
            await wait_until(lambda: consumers.statuses("relay/0") == {"zone-a/c0": pb.ReplicaStatus.FAILED}, 30)
            listed = {s.spec.id: s for s in (await sc.list()).shards}
    reason = listed["relay/0"].status[0].errors[0]
    assert "output journal 'relay/side'" in reason and "source" not in reason, reason
    # m1's transaction did not commit: a later primary consumes it again (after the journal is back).
    assert seen(consumers.data_dir / "relay%2F0.db") == {"m0": 1}


class DeletesDownstreamAfterCommit(WordCount):
    def __init__(self, path, client) -> None:
        super().__init__(path)
        self.client, self.deleted = client, False

    async def finished_txn(self, shard, store, commit) -> None:
        await commit
        if not self.deleted:  # (an operator deleting the downstream journal at this moment)
            self.deleted = True
            revision = {j.spec.name: j.mod_revision for j in (await self.client.list()).journals}["wc/out"]
            await self.client.apply([pb.ApplyRequest.Change(delete="wc/out", expect_mod_revision=revision)])


async def test_failed_acks_fail_the_idle_shard(cluster, tmp_path) -> None:
    """A transaction's ACKs failing for good (here: its downstream journal deleted between the store
    commit and the ACK append) fail the shard, naming why, although no further input comes to start
    the next transaction: it does not stay PRIMARY for ever, its progress frozen (Stat waiting out its
    deadline) and those downstream messages never acknowledged."""
    await cluster.create_journal("wc/in", 1)
    await cluster.create_journal("wc/out", 1)
    await produce(cluster, ["apple", "fig"] * 10)
    async with cluster.client() as c:
        app = DeletesDownstreamAfterCommit(tmp_path / "wc.db", c)
        stop = asyncio.Event()
        shard = Shard(spec(), c)
        task = asyncio.ensure_future(serve_primary(c, spec(), app, stop, shard))
        try:
            done, _ = await asyncio.wait([task], timeout=10)
            assert done, (
                f"the shard runs on although its last ACKs failed (read_through {shard.read_through}, "
                f"deleted={app.deleted})"
            )
            with pytest.raises(Exception):  # noqa: B017 (any failure naming the journal will do)
                task.result()
        finally:
            stop.set()
            if not task.done():
                task.cancel()
            await asyncio.wait([task])
