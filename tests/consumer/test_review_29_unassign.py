"""Review 29: `shards unassign` of a busy shard on its only process: the replica is closed (its open
transaction commits) while the allocator assigns the shard again to the same process at once, so a
second primary of the shard starts in the process on the same SQLite file before the first stopped.
Its effects must still land exactly once and the shard come back PRIMARY."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

from tests.consumer.test_service import downstream, produce, shard
from tests.support.consumers import PRIMARY, WORDS, counts
from tests.support.waiting import wait_until
from tidings.consumer.client import ShardClient
from tidings.protocol import protocol_pb2 as pb


async def test_unassign_and_reassign_while_busy_is_exactly_once(cluster, consumers) -> None:
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
