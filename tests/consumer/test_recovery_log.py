"""Stateful shards survive the loss of their process without a shared disk (DESIGN.md invariants 8
and 10): with a recovery log, a shard's store is recorded; a hot standby plays the log in its own
directory (BACKFILL, then STANDBY), takes over when the primary goes, and the counts stay exact;
a replica whose log journal is missing FAILS naming it; a process clears what a dead process of its
id left in its directory only once announced, never while that process may still run. Real etcd and
brokers; consumers in this process, each playing logs in its own directory."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections import Counter

from tests.consumer.test_service import downstream, produce, shard
from tests.support.consumers import FAILED, PRIMARY, STANDBY, WORDS, RecordedCounts
from tests.support.waiting import wait_until
from tidings.consumer.client import ShardClient
from tidings.consumer.recovery import CONTENT_TYPE
from tidings.consumer.recoverylog.player import Player
from tidings.consumer.service import Consumer
from tidings.consumer.store_recorded import DATABASE
from tidings.protocol import protocol_pb2 as pb

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
