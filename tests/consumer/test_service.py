"""The consumer process serves the shards the allocator assigns it, each exactly once (DESIGN.md
invariant 8): shards applied through the Shard service are served as primaries (statuses in etcd),
handed off when a process stops, stopped when demoted to a standby, and FAILED (with the reason,
visible in List) when a source journal is deleted, while the process keeps serving its other shards.
Real etcd and brokers; the consumers run in this process (tests/cli/test_shards.py runs one as a child
process)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter, defaultdict

import grpc
import pytest

from tests.support.consumers import FAILED, PRIMARY, STANDBY, WORDS, Counts, RecordedCounts, counts
from tests.support.waiting import wait_until
from tidings.client import AppendService
from tidings.consumer.client import ShardClient
from tidings.consumer.service import Consumer, ConsumerConfig
from tidings.message import Publisher, read_committed
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol import protocol_pb2_grpc as pb_grpc
from tidings.protocol.specs import shard_from_dict
from tidings.protocol.status import TransportError


def shard(i: int, **fields) -> pb.ShardSpec:
    return shard_from_dict({"id": f"wc/{i}", "sources": [f"wc/in/{i}"], "max_txn_duration": "200ms", **fields})


async def produce(cluster, journal: str, words: list[str]) -> None:
    async with cluster.client() as c:
        pub = Publisher(AppendService(c))
        for i in range(0, len(words), 20):
            await (await pub.publish_committed(journal, *({"word": w} for w in words[i : i + 20])))
        await pub.service.aclose()


async def downstream(cluster, journal: str) -> dict[str, list[int]]:
    seen: dict[str, list[int]] = defaultdict(list)
    async with cluster.client() as c:
        async for env in read_committed(c, journal, block=False):
            seen[env.message["word"]].append(env.message["n"])
    return dict(seen)


async def create_journals(cluster, n: int = 2) -> None:
    for i in range(n):
        await cluster.create_journal(f"wc/in/{i}", 1)
        await cluster.create_journal(f"wc/out/{i}", 1)


async def two_shards_served(cluster, consumers, app=None, **fields) -> Consumer:
    """Journals wc/in/{0,1} and wc/out/{0,1} (and recovery logs if the shards have them), shards wc/0 and
    wc/1 primaries on a first consumer (returned)."""
    await create_journals(cluster)
    if fields.get("recovery_log_prefix"):
        for i in range(2):
            labels = {"content-type": "application/x-recoverylog"}
            await cluster.create_journal(f"{fields['recovery_log_prefix']}/wc/{i}", 1, labels=labels)
    a = await consumers.add("zone-a", app=app)
    async with ShardClient(a.endpoint) as sc:
        await sc.apply([pb.ShardApplyRequest.Change(upsert=shard(i, **fields)) for i in range(2)])
    await wait_until(lambda: all(consumers.statuses(f"wc/{i}") == {"zone-a/c0": PRIMARY} for i in range(2)), 30)
    return a


async def test_shards_are_served_and_handed_off_exactly_once(cluster, consumers) -> None:
    a = await two_shards_served(cluster, consumers)
    async with ShardClient(a.endpoint) as sc:
        rng = random.Random(5)
        words = {i: [rng.choice(WORDS) for _ in range(300)] for i in range(2)}
        await produce(cluster, "wc/in/0", words[0][:150])
        async with cluster.client() as c:
            head = await c.write_head("wc/in/0")
        stat = await sc.stat("wc/0", {"wc/in/0": head})  # read your own writes
        assert stat.read_through["wc/in/0"] >= head
        assert counts(consumers.data_dir / "wc%2F0.db") == Counter(words[0][:150])

        # A second process joins; the first stops (SIGTERM's path) while input keeps coming.
        b = await consumers.add("zone-b")
        producing = asyncio.ensure_future(
            asyncio.gather(produce(cluster, "wc/in/0", words[0][150:]), produce(cluster, "wc/in/1", words[1]))
        )
        await a.stop(graceful=True)
        await producing
    await wait_until(lambda: all(consumers.statuses(f"wc/{i}") == {"zone-b/c1": PRIMARY} for i in range(2)), 30)
    async with ShardClient(b.endpoint) as sc:
        for i in range(2):
            async with cluster.client() as c:
                head = await c.write_head(f"wc/in/{i}")
            await sc.stat(f"wc/{i}", {f"wc/in/{i}": head})
        listed = await sc.list()
    for i in range(2):
        assert counts(consumers.data_dir / f"wc%2F{i}.db") == Counter(words[i])
        expected = {w: list(range(1, n + 1)) for w, n in Counter(words[i]).items()}
        assert await downstream(cluster, f"wc/out/{i}") == expected
    listed_statuses = [(s.spec.id, [st.code for st in s.status]) for s in listed.shards]
    assert listed_statuses == [("wc/0", [PRIMARY]), ("wc/1", [PRIMARY])]


async def test_a_demoted_primary_stops_and_stands_by(cluster, consumers) -> None:
    """A primary demoted to a standby slot (the allocator's primary spread swaps slots 0 and 1 in one
    etcd transaction) stops serving and stands by: it does not run on as a zombie, to be fenced by the
    new primary and write FAILED into its standby assignment (which would stick until `shards
    unassign`)."""
    a = await two_shards_served(cluster, consumers, RecordedCounts(), hot_standbys=1, recovery_log_prefix="wc/log")
    async with ShardClient(a.endpoint) as sc:
        # B joins: it gets both standbys, then the balance moves one primary to it (a slot swap).
        await consumers.add("zone-b", app=RecordedCounts())

        def spread() -> bool:
            st = [consumers.statuses(f"wc/{i}") for i in range(2)]
            return sorted(s.get("zone-b/c1", -1) for s in st) == sorted([STANDBY, PRIMARY]) and all(
                len(s) == 2 for s in st
            )

        await wait_until(spread, 30)
        moved = next(i for i in range(2) if consumers.statuses(f"wc/{i}")["zone-b/c1"] == PRIMARY)
        words = ["apple", "fig", "grape"] * 20
        await produce(cluster, f"wc/in/{moved}", words)
        async with cluster.client() as c:
            head = await c.write_head(f"wc/in/{moved}")
        await sc.stat(f"wc/{moved}", {f"wc/in/{moved}": head})
        expected = {w: list(range(1, n + 1)) for w, n in Counter(words).items()}
        assert await downstream(cluster, f"wc/out/{moved}") == expected
        # The demoted replica on A must be a plain standby: no primary task still running there.
        replica = a.replicas[f"wc/{moved}"]
        await wait_until(lambda: replica._primary is None or replica._primary.done(), 10)
        # (it reaches STANDBY once it has played the log past what it served: BACKFILL until then)
        stood_by = {"zone-a/c0": STANDBY, "zone-b/c1": PRIMARY}
        await wait_until(lambda: consumers.statuses(f"wc/{moved}") == stood_by, 30)


async def test_a_deleted_source_fails_its_shard_only(cluster, consumers) -> None:
    a = await two_shards_served(cluster, consumers)
    async with ShardClient(a.endpoint) as sc:
        async with cluster.client() as c:
            revision = {j.spec.name: j.mod_revision for j in (await c.list()).journals}["wc/in/1"]
            await c.apply([pb.ApplyRequest.Change(delete="wc/in/1", expect_mod_revision=revision)])
        await wait_until(lambda: consumers.statuses("wc/1") == {"zone-a/c0": FAILED}, 30)
        listed = {s.spec.id: s for s in (await sc.list()).shards}
        assert "wc/in/1" in listed["wc/1"].status[0].errors[0], listed["wc/1"].status[0].errors
        # The other shard is served on.
        await produce(cluster, "wc/in/0", ["apple", "fig"])
        async with cluster.client() as c:
            head = await c.write_head("wc/in/0")
        await sc.stat("wc/0", {"wc/in/0": head})
        assert counts(consumers.data_dir / "wc%2F0.db") == {"apple": 1, "fig": 1}
        # Unassign --failed only touches the failed one; it is assigned again (and fails again: still no source).
        assert await sc.unassign(["wc/0", "wc/1"], only_failed=True) == ["wc/1"]
        await wait_until(lambda: consumers.statuses("wc/1") == {"zone-a/c0": FAILED}, 30)
        assert consumers.statuses("wc/0") == {"zone-a/c0": PRIMARY}


async def test_invalid_shard_specs_are_refused_with_one_line(cluster, consumers) -> None:
    a = await consumers.add("zone-a")
    async with ShardClient(a.endpoint) as sc:
        bad = pb.ShardSpec(id="wc/0", max_txn_duration_ms=1000)  # no sources
        with pytest.raises(TransportError) as caught:
            await sc.apply([pb.ShardApplyRequest.Change(upsert=bad)])
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "sources" in str(caught.value) and "\n" not in str(caught.value)
        assert (await sc.list()).shards == []


async def test_stat_past_its_deadline_fails_rather_than_answering_ok(cluster, consumers) -> None:
    """A Stat whose offsets are not read through by its deadline fails (DEADLINE_EXCEEDED over the
    wire, TimeoutError from ShardClient), as Gazette's does: an OK always means read through."""
    a = await two_shards_served(cluster, consumers)
    async with grpc.aio.insecure_channel(a.endpoint) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            req = pb.StatRequest(shard="wc/0", read_through={"wc/in/0": 10**9})
            await pb_grpc.ShardStub(channel).Stat(req, timeout=2.0)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "has not read through" in caught.value.details()
    async with ShardClient(a.endpoint) as sc:
        with pytest.raises(TimeoutError, match="has not read through"):
            await sc.stat("wc/0", {"wc/in/0": 10**9}, timeout=2.0)


async def test_stat_waits_across_a_spec_change_and_ignores_journals_that_are_not_sources(
    cluster, consumers, monkeypatch
) -> None:
    """A Stat waiting while the shard's primary restarts under a changed spec is answered by the new
    primary (the shard never moved); offsets of journals the shard does not read are ignored (Gazette)."""
    from tidings.consumer import Shard

    a = await two_shards_served(cluster, consumers)
    entered = asyncio.Event()
    wait_read_through = Shard.wait_read_through

    async def observed(self, offsets, timeout=None):
        entered.set()
        return await wait_read_through(self, offsets, timeout)

    monkeypatch.setattr(Shard, "wait_read_through", observed)
    async with cluster.client() as c:
        head = await c.write_head("wc/in/0")
    async with ShardClient(a.endpoint) as sc:
        waiting = asyncio.ensure_future(sc.stat("wc/0", {"wc/in/0": head + 1, "wc/out/1": 10**9}, timeout=30))
        await asyncio.wait_for(entered.wait(), 30)  # (the Stat waits on the first primary...)
        changed = shard(0, max_txn_duration="300ms")
        await sc.apply([pb.ShardApplyRequest.Change(upsert=changed, expect_mod_revision=-1)])  # (...which restarts)
        await produce(cluster, "wc/in/0", ["apple"])
        resp = await waiting
    assert resp.read_through["wc/in/0"] > head


async def test_a_consumer_whose_broker_does_not_answer_says_so_at_start(cluster, etcd_root, tmp_path) -> None:
    """The shards' client waits out outages for ever, so a --broker that never answered is refused at
    start, in seconds, naming the flag (a port nobody listens on; etcd's port: gRPC, not a broker)."""
    import socket

    from tidings.protocol.status import UsageError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{s.getsockname()[1]}"  # (closed again before the consumer tries it)
    for broker in (nobody, cluster.etcd_endpoint):
        cfg = ConsumerConfig(etcd=cluster.etcd_endpoint, broker=broker, app=Counts(), root=etcd_root + "-c",
                             data_dir=tmp_path, lease_ttl=2)  # fmt: skip
        with pytest.raises(UsageError, match="--broker") as caught:
            await asyncio.wait_for(Consumer(cfg).start(), 20)
        assert broker in str(caught.value) and "\n" not in str(caught.value)
