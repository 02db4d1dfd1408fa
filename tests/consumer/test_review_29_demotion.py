"""Review 29: a primary demoted to a standby slot (the allocator's primary spread swaps slots 0 and 1
in one etcd transaction) must stop serving; otherwise it runs on as a zombie, is fenced by the new
primary and writes FAILED into its standby assignment, which sticks until `shards unassign`."""

from __future__ import annotations

from collections import Counter

from tests.consumer.test_service import produce, two_shards_served
from tests.support.consumers import PRIMARY, STANDBY, counts
from tests.support.waiting import wait_until
from tidings.consumer.client import ShardClient


async def test_a_demoted_primary_stops_and_stands_by(cluster, consumers) -> None:
    a = await two_shards_served(cluster, consumers, hot_standbys=1, recovery_log_prefix="wc/log")
    async with ShardClient(a.endpoint) as sc:
        # B joins: it gets both standbys, then the balance moves one primary to it (a slot swap).
        await consumers.add("zone-b")

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
        assert counts(consumers.data_dir / f"wc%2F{moved}.db") == Counter(words)
        # The demoted replica on A must be a plain standby: no primary task still running there.
        replica = a.replicas[f"wc/{moved}"]
        await wait_until(lambda: replica._primary is None or replica._primary.done(), 10)
        assert consumers.statuses(f"wc/{moved}") == {"zone-a/c0": STANDBY, "zone-b/c1": PRIMARY}
