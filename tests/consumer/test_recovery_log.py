"""Stateful shards survive the loss of their process without a shared disk (DESIGN.md invariants 8
and 10). Real etcd and brokers; consumers in this process (each playing logs in its own directory) or
as `tidings consumer` children.

- A hot standby plays the log (BACKFILL, then STANDBY), takes over when the primary goes, and the
  counts stay exact; a zombie primary (stopped past its lease, then resumed) records nothing after
  its successor's handoff and stops; a handoff landing late from a replica that stalled past its
  lease does not stop the primary it fences (still assigned, it takes the log back).
- A replica whose log journal is missing FAILS naming it; an upsert never moves a shard's store to
  another recovery log (or to or from none), which would start it empty, nor its hints elsewhere;
  a shard deleted and made again on a new log serves from it (every hint slot went with it, also
  backups above a lowered hint_backups); an apply of many shards stays within etcd's limits.
- A rollover's new hints are in etcd at once (a player skips the old history from then on).
- A process clears what a dead process of its id left in its directory only once announced, never
  while that process may still run."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import signal
from collections import Counter

import grpc
import pytest
from prometheus_client import REGISTRY

from tests.consumer.test_service import downstream, produce, shard
from tests.support.consumer_procs import ConsumerProcs
from tests.support.consumers import FAILED, PRIMARY, STANDBY, WORDS, RecordedCounts, SmallRollovers
from tests.support.waiting import wait_until
from tidings.consumer import replica as replica_module
from tidings.consumer.client import ShardClient
from tidings.consumer.recovery import CONTENT_TYPE
from tidings.consumer.recoverylog.hints import HintKeys, fetch_raw
from tidings.consumer.recoverylog.player import Player
from tidings.consumer.service import Consumer
from tidings.consumer.store_recorded import DATABASE
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import TransportError

SPEC = {"recovery_log_prefix": "wc/log", "hot_standbys": 1}


async def journals(cluster, log: bool = True) -> None:
    await cluster.create_journal("wc/in/0", 1)
    await cluster.create_journal("wc/out/0", 1)
    if log:
        await cluster.create_journal("wc/log/wc/0", 3, labels={"content-type": CONTENT_TYPE})


async def played_counts(cluster, tmp_path) -> dict[str, int]:
    """The counts in the shard's store as its recovery log holds them (played into a fresh directory)."""
    import sqlite3

    async with cluster.client() as c:
        player = Player(c, pb.FSMHints(log="wc/log/wc/0"), tmp_path / "played")
        player.finish_at_write_head()
        await player.play()
    db = sqlite3.connect(tmp_path / "played" / DATABASE)
    try:
        return dict(db.execute("SELECT word, n FROM counts").fetchall())
    finally:
        db.close()


async def test_a_hot_standby_takes_over_and_the_counts_stay_exact(cluster, consumers, tmp_path) -> None:
    await journals(cluster)
    a = await consumers.add("zone-a", app=RecordedCounts())
    async with ShardClient(a.endpoint) as sc:
        await sc.apply([pb.ShardApplyRequest.Change(upsert=shard(0, **SPEC))])
    await wait_until(lambda: consumers.statuses("wc/0") == {"zone-a/c0": PRIMARY}, 30)
    b = await consumers.add("zone-b", app=RecordedCounts())
    await wait_until(lambda: consumers.statuses("wc/0") == {"zone-a/c0": PRIMARY, "zone-b/c1": STANDBY}, 30)
    assert a.recovered_dir != b.recovered_dir

    rng = random.Random(7)
    words = [rng.choice(WORDS) for _ in range(400)]
    await produce(cluster, "wc/in/0", words[:200])
    async with ShardClient(a.endpoint) as sc, cluster.client() as c:
        await sc.stat("wc/0", {"wc/in/0": await c.write_head("wc/in/0")})
    producing = asyncio.ensure_future(produce(cluster, "wc/in/0", words[200:]))
    await a.stop(graceful=True)  # (SIGTERM's path: the standby takes over)
    await producing
    await wait_until(lambda: consumers.statuses("wc/0").get("zone-b/c1") == PRIMARY, 30)
    async with ShardClient(b.endpoint) as sc, cluster.client() as c:
        await sc.stat("wc/0", {"wc/in/0": await c.write_head("wc/in/0")})
    expected = {w: list(range(1, n + 1)) for w, n in Counter(words).items()}
    assert await downstream(cluster, "wc/out/0") == expected  # each running count once, in order
    assert await played_counts(cluster, tmp_path) == Counter(words)


async def test_a_replica_whose_recovery_log_is_missing_fails_naming_it(cluster, consumers) -> None:
    await journals(cluster, log=False)
    a = await consumers.add("zone-a", app=RecordedCounts())
    async with ShardClient(a.endpoint) as sc:
        await sc.apply([pb.ShardApplyRequest.Change(upsert=shard(0, **SPEC))])
        await wait_until(lambda: consumers.statuses("wc/0") == {"zone-a/c0": FAILED}, 30)
        listed = await sc.list()
    (status,) = listed.shards[0].status
    assert "'wc/log/wc/0' does not exist" in status.errors[0], status


async def test_a_process_clears_its_recovery_directory_only_once_announced(cluster, consumers) -> None:
    await journals(cluster)
    a = await consumers.add("zone-a", app=RecordedCounts())
    async with ShardClient(a.endpoint) as sc:
        await sc.apply([pb.ShardApplyRequest.Change(upsert=shard(0, **SPEC))])
    await wait_until(lambda: consumers.statuses("wc/0") == {"zone-a/c0": PRIMARY}, 30)
    (recording,) = a.recovered_dir.iterdir()  # the primary's recorded store
    stale = a.recovered_dir / "stale"  # (as a killed process of this id leaves behind)
    stale.mkdir()

    again = Consumer(dataclasses.replace(a.config, listen="127.0.0.1:0"))  # the same id: a restart
    starting = asyncio.ensure_future(again.start())
    try:
        await wait_until(lambda: getattr(again, "spec", None) is not None, 30)  # (announcing: waits for `a`)
        assert not starting.done()
        assert recording.exists() and stale.exists()  # `a` records on in its directory, untouched
        await a.stop(graceful=False)
        await asyncio.wait_for(starting, 30)
        assert not stale.exists()  # cleared once announced
    finally:
        if not starting.done():
            starting.cancel()
        await asyncio.wait([starting])
        if starting.done() and not starting.cancelled() and starting.exception() is None:
            await again.stop(graceful=False)


async def test_a_zombie_primary_records_nothing_after_its_successors_handoff(cluster, etcd_root, tmp_path) -> None:
    """SIGSTOP the primary mid-stream past its lease: the standby takes over and hands the log off;
    SIGCONT: every recorder append of the zombie fails its register check (the log, played, skips no
    op of a dead branch), it stops, and each word is counted once."""
    await journals(cluster)
    procs = ConsumerProcs(cluster, etcd_root + "-consumer", tmp_path, "tests.support.consumers:RecordedCounts")
    words = [random.Random(11).choice(WORDS) for _ in range(600)]
    try:
        a = await procs.start("c0", "zone-a")
        async with ShardClient(a) as sc:
            # (transactions held open 2-4 s: the primary stopped mid-stream is mid-transaction)
            slow = shard(0, **SPEC, min_txn_duration="2s", max_txn_duration="4s")
            await sc.apply([pb.ShardApplyRequest.Change(upsert=slow)])

        async def statuses(via: str = "c0") -> dict[str, int]:
            async with ShardClient(procs.endpoints[via]) as sc:
                (listed,) = (await sc.list()).shards
            return {f"{m.zone}/{m.suffix}": st.code for m, st in zip(listed.route.members, listed.status, strict=True)}

        await wait_until(lambda: _eq(statuses(), {"zone-a/c0": PRIMARY}), 30, interval=0.2)
        await procs.start("c1", "zone-b")
        await wait_until(lambda: _eq(statuses(), {"zone-a/c0": PRIMARY, "zone-b/c1": STANDBY}), 30, interval=0.2)
        await produce(cluster, "wc/in/0", words[:200])
        producing = asyncio.ensure_future(produce(cluster, "wc/in/0", words[200:400]))
        procs.procs["c0"].send_signal(signal.SIGSTOP)  # (mid-stream, most likely in a transaction)
        try:
            await producing
            await wait_until(lambda: _eq(statuses("c1"), {"zone-b/c1": PRIMARY}, some=True), 60, interval=0.2)
            async with ShardClient(procs.endpoints["c1"]) as sc, cluster.client() as c:
                await sc.stat("wc/0", {"wc/in/0": await c.write_head("wc/in/0")})
        finally:
            procs.procs["c0"].send_signal(signal.SIGCONT)
        await procs.wait_exit("c0", 60)  # the zombie stops (its lease is gone)
        zombie = procs.log("c0")  # (stopped mid-transaction: it tried to commit it, and was fenced)
        assert "REGISTER_MISMATCH" in zombie and "a newer primary took the log over" in zombie, zombie[-3000:]
        await produce(cluster, "wc/in/0", words[400:])
        async with ShardClient(procs.endpoints["c1"]) as sc, cluster.client() as c:
            await sc.stat("wc/0", {"wc/in/0": await c.write_head("wc/in/0")})
            player = Player(c, pb.FSMHints(log="wc/log/wc/0"), tmp_path / "played")
            player.finish_at_write_head()
            await player.play()
        assert player.statistics().skipped == 0, "an op of the zombie landed after the handoff"
        expected = {w: list(range(1, n + 1)) for w, n in Counter(words).items()}
        assert await downstream(cluster, "wc/out/0") == expected  # each running count once, in order
        assert await played_counts(cluster, tmp_path / "again") == Counter(words)
    finally:
        procs.stop_all()


async def _eq(got, want: dict[str, int], some: bool = False) -> bool:
    have = await got
    return all(have.get(k) == v for k, v in want.items()) if some else have == want


async def test_a_shards_store_is_not_moved_to_another_log_by_an_upsert(cluster, consumers) -> None:
    await journals(cluster)
    a = await consumers.add("zone-a", app=RecordedCounts())
    async with ShardClient(a.endpoint) as sc:
        await sc.apply([pb.ShardApplyRequest.Change(upsert=shard(0, **SPEC))])
        await sc.apply([pb.ShardApplyRequest.Change(upsert=shard(1))])
        await wait_until(lambda: consumers.statuses("wc/0") == {"zone-a/c0": PRIMARY}, 30)
        moves = [shard(0, recovery_log_prefix="wc/other"), shard(0), shard(1, recovery_log_prefix="wc/log"),
                 shard(0, **SPEC, hint_prefix="/elsewhere")]  # fmt: skip
        for moved in moves:
            with pytest.raises(TransportError) as refused:
                await sc.apply([pb.ShardApplyRequest.Change(upsert=moved, expect_mod_revision=-1)])
            assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "recovery_log_prefix" in str(refused.value) or "hint_prefix" in str(refused.value)
        specs = {s.spec.id: s.spec for s in (await sc.list()).shards}
        assert specs["wc/0"].recovery_log_prefix == "wc/log" and not specs["wc/1"].recovery_log_prefix
        kept = shard(0, **SPEC, hint_backups=3)  # (anything else may change)
        await sc.apply([pb.ShardApplyRequest.Change(upsert=kept, expect_mod_revision=-1)])
        assert {s.spec.id: s.spec for s in (await sc.list()).shards}["wc/0"].hint_backups == 3


async def test_a_shard_deleted_and_made_again_on_a_new_log_serves_from_it(cluster, consumers) -> None:
    await journals(cluster)
    await cluster.create_journal("wc/log2/wc/0", 1, labels={"content-type": CONTENT_TYPE})
    a = await consumers.add("zone-a", app=RecordedCounts())
    async with ShardClient(a.endpoint) as sc:
        await sc.apply([pb.ShardApplyRequest.Change(upsert=shard(0, **SPEC, hint_backups=2))])
        await wait_until(lambda: consumers.statuses("wc/0") == {"zone-a/c0": PRIMARY}, 30)
        (listed,) = (await sc.list()).shards  # (a backup slot above the hint_backups it is deleted with)
        await a.etcd.put(HintKeys(a.hint_prefix, "wc/0", 2).backup(1), listed.status[0].SerializeToString())
        lowered = pb.ShardApplyRequest.Change(upsert=shard(0, **SPEC, hint_backups=1), expect_mod_revision=-1)
        await sc.apply([lowered])
        await produce(cluster, "wc/in/0", ["apple"] * 10)
        async with cluster.client() as c:
            await sc.stat("wc/0", {"wc/in/0": await c.write_head("wc/in/0")})
        await wait_until(lambda: _stored_hints(sc), 30)  # (its recovered hints are in etcd)
        (listed,) = (await sc.list()).shards
        await sc.apply([pb.ShardApplyRequest.Change(delete="wc/0", expect_mod_revision=listed.mod_revision)])
        left = await fetch_raw(a.etcd, HintKeys(a.hint_prefix, "wc/0", 2))
        assert all(value is None for _, value in left.values()), left  # gone with the shard
        await wait_until(lambda: "wc/0" not in a.replicas, 30)
        await sc.apply([pb.ShardApplyRequest.Change(upsert=shard(0, **{**SPEC, "recovery_log_prefix": "wc/log2"}))])
        await wait_until(lambda: consumers.statuses("wc/0").get("zone-a/c0") in (PRIMARY, FAILED), 30)
        assert a.replicas["wc/0"].status.code == PRIMARY, a.replicas["wc/0"].status


async def _stored_hints(sc: ShardClient) -> bool:
    return (await sc.get_hints("wc/0")).primary_hints.HasField("hints")


async def test_a_late_handoff_of_a_stalled_replica_never_stops_the_primary(cluster, consumers, caplog) -> None:
    """A replica promoted to primary sends its handoff no-op; its process then stalls with the append
    in flight (SIGSTOP, a GC or VM pause, a slow network) and loses its lease. The next standby, C,
    hands off and serves. B's append then lands: out of sequence, the log skips it, but it sets the
    log's author register to B, fencing C's recorder. C, still assigned the shard in etcd, takes the
    log over again (no FAILED shard waiting for an operator), and every word is counted once. The late
    no-op is the very request B's player sent, delivered late by a second connection (what a stalled
    process's request on the wire does)."""
    await cluster.create_journal("wc/in/0", 1)
    await cluster.create_journal("wc/out/0", 1)
    await cluster.create_journal("wc/log/wc/0", 1, labels={"content-type": CONTENT_TYPE})
    spec = shard(0, recovery_log_prefix="wc/log", hot_standbys=1)
    a = await consumers.add("zone-a", app=RecordedCounts())
    async with ShardClient(a.endpoint) as sc:
        await sc.apply([pb.ShardApplyRequest.Change(upsert=spec)])
    await wait_until(lambda: consumers.statuses("wc/0") == {"zone-a/c0": PRIMARY}, 30)
    b = await consumers.add("zone-b", app=RecordedCounts())
    c = await consumers.add("zone-c", app=RecordedCounts())
    await wait_until(lambda: sorted(consumers.statuses("wc/0").values()) == sorted([PRIMARY, STANDBY]), 30)

    rng = random.Random(30)
    words = [rng.choice(WORDS) for _ in range(300)]
    await produce(cluster, "wc/in/0", words[:100])
    await _stat_through(cluster, a.endpoint)

    held: dict[str, asyncio.Task] = {}
    release = asyncio.Event()
    late = cluster.client()
    await late.__aenter__()

    def stalling(consumer):
        real = consumer.client.append

        async def append(journal, content=b"", **kw):
            if kw.get("union_registers") is None or held:
                return await real(journal, content, **kw)

            async def on_the_wire():
                await release.wait()
                return await late.append(journal, content, **kw)

            held[consumer.config.suffix] = task = asyncio.ensure_future(on_the_wire())
            return await asyncio.shield(task)  # (the caller giving up does not take the bytes back)

        consumer.client.append = append

    stalling(b)
    stalling(c)
    try:
        await a.stop(graceful=False)  # the primary dies; a standby is promoted and hands off: held
        await wait_until(lambda: held, 30)
        ((stalled, _task),) = held.items()
        promoted, survivor = (b, c) if stalled == b.config.suffix else (c, b)
        await promoted.stop(graceful=False)  # it loses its lease with its handoff in flight
        await wait_until(
            lambda: consumers.statuses("wc/0") == {f"{survivor.config.zone}/{survivor.config.suffix}": PRIMARY}, 30
        )
        await produce(cluster, "wc/in/0", words[100:200])
        await _stat_through(cluster, survivor.endpoint)  # the successor serves

        release.set()  # the stalled handoff lands now
        await held[stalled]
        await produce(cluster, "wc/in/0", words[200:])

        replica = survivor.replicas["wc/0"]

        async def read_through_or_failed() -> bool:
            if replica.status.code == FAILED:
                return True
            async with cluster.client() as cl:
                head = await cl.write_head("wc/in/0")
            return replica.shard is not None and replica.shard.read_through.get("wc/in/0", 0) >= head

        await wait_until(read_through_or_failed, 30)
        assert replica.status.code != FAILED, f"the successor was fenced by a dead replica's handoff: {replica.status}"
        assert "taking its log over again" in caplog.text  # (it was fenced, and took the log back)
        expected = {w: list(range(1, n + 1)) for w, n in Counter(words).items()}
        assert await downstream(cluster, "wc/out/0") == expected
    finally:
        release.set()
        await late.__aexit__(None, None, None)


async def _stat_through(cluster, endpoint: str) -> None:
    async with ShardClient(endpoint) as sc, cluster.client() as c:
        await sc.stat("wc/0", {"wc/in/0": await c.write_head("wc/in/0")})


async def test_a_rollover_writes_the_shards_hints_at_once(cluster, consumers) -> None:
    await journals(cluster)
    a = await consumers.add("zone-a", app=SmallRollovers())
    async with ShardClient(a.endpoint) as sc:
        await sc.apply([pb.ShardApplyRequest.Change(upsert=shard(0, **SPEC))])
        await wait_until(lambda: consumers.statuses("wc/0") == {"zone-a/c0": PRIMARY}, 30)

        async def first_hinted_offset() -> int:
            hinted = (await sc.get_hints("wc/0")).primary_hints.hints
            return min((seg.first_offset for n in hinted.live_nodes for seg in n.segments), default=0)

        await wait_until(lambda: _stored_hints(sc), 30)  # (the recovered hints, stored once restored)
        start = await first_hinted_offset()
        rollovers = REGISTRY.get_sample_value("tidings_recoverylog_rollovers_total", {"log": "wc/log/wc/0"}) or 0
        rng = random.Random(3)
        while (
            REGISTRY.get_sample_value("tidings_recoverylog_rollovers_total", {"log": "wc/log/wc/0"}) or 0
        ) == rollovers:
            await produce(cluster, "wc/in/0", [rng.choice(WORDS) + "x" * 200 for _ in range(100)])
            async with cluster.client() as c:
                await sc.stat("wc/0", {"wc/in/0": await c.write_head("wc/in/0")})
        assert replica_module.HINT_INTERVAL >= 60
        await wait_until(lambda: _past(first_hinted_offset(), start), 30)  # (well before HINT_INTERVAL)


async def _past(offset, start: int) -> bool:
    return await offset > start


async def test_an_apply_of_many_shards_stays_within_etcds_limits(cluster, consumers) -> None:
    """etcd refuses a transaction of more than 128 compares or ops: each upsert carries one compare
    (its expectation, or the revision its recovery log was checked at), each delete its hint slots."""
    a = await consumers.add("zone-a")
    many = [shard(i, disable=True) for i in range(100)]  # (none served: the applies are what is tested)
    async with ShardClient(a.endpoint) as sc:
        await sc.apply([pb.ShardApplyRequest.Change(upsert=s) for s in many])  # (expect 0: created)
        await sc.apply([pb.ShardApplyRequest.Change(upsert=s, expect_mod_revision=-1) for s in many])
        listed = {s.spec.id: s.mod_revision for s in (await sc.list()).shards}
        await sc.apply([pb.ShardApplyRequest.Change(upsert=s, expect_mod_revision=listed[s.id]) for s in many])
        assert len((await sc.list()).shards) == 100
