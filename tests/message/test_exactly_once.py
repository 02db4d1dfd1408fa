"""Exactly-once end to end (DESIGN.md invariant 7), on brokers and producers that are real processes.

Four transactional producers (`tests/support/producer.py`) publish transactions of random size
into two R=3 journals. Producers die (SIGKILL) mid-transaction, after committing a checkpoint but
before writing its ACKs, and after the ACKs, and are restarted from their last checkpoint,
re-writing its ACK intents; the primary broker of a journal is killed meanwhile, so appends are
retried. A read-committed reader must then yield every committed message exactly once, in order
per producer and journal, and no message of an abandoned attempt.

TIDINGS_EO_TXNS sets the transactions per producer (default 12; raise it for a longer campaign).
"""

from __future__ import annotations

import json
import signal
from collections import defaultdict
from pathlib import Path

from tests.support.cluster import create_local_journal
from tests.support.producer import transaction_size
from tests.support.producers import TXNS, Producer
from tests.support.waiting import wait_until
from tidings.client import AsyncClient
from tidings.cluster import LocalCluster
from tidings.message import read_committed


async def test_read_committed_yields_each_committed_message_once_across_producer_and_broker_kills(
    local_cluster: LocalCluster, tmp_path: Path
) -> None:
    lc = local_cluster
    labels = {"topic": "eo", "content-type": "application/x-ndjson"}
    journals = ["eo/events-0", "eo/events-1"]
    for name in journals:
        await create_local_journal(lc, name, labels=labels)
    producers = [Producer(i, lc, tmp_path / f"producer-{i}.json") for i in range(4)]
    try:
        for p in producers:
            p.start()

        def poll_all() -> bool:
            for p in producers:
                p.poll()
            return all(p.done for p in producers)

        # Mid-run: SIGKILL producer 3 from outside, and the primary broker of the first journal.
        await wait_until(lambda: poll_all() or producers[3].next_txn() >= 3, 60)
        producers[3].proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
        async with AsyncClient(lc.endpoints[-1]) as c:
            route = next(j.route for j in (await c.list()).journals if j.spec.name == journals[0])
        victim = next(b for b in lc.brokers if b.suffix == route.members[route.primary].suffix)
        victim.kill()
        await wait_until(poll_all, 120, interval=0.05)
    finally:
        for p in producers:
            p.stop()

    async with AsyncClient(lc.endpoints[0]) as c:
        reader = read_committed(c, journals, block=False)
        delivered = [env async for env in reader]
    print("STARTS", [p.starts for p in producers], len(delivered))
    assert reader.garbage == 0
    assert sum(p.starts for p in producers) >= 4 + 6, "every planned death happened and was restarted"

    seen: dict[tuple[int, int, int], int] = defaultdict(int)
    order: dict[tuple[int, str], list[tuple[int, int]]] = defaultdict(list)
    for env in delivered:
        m = env.message
        seen[(m["p"], m["txn"], m["i"])] += 1
        order[(m["p"], env.journal)].append((m["txn"], m["i"]))
        committed = json.loads(producers[m["p"]].state.read_text())["committed"]
        assert m["attempt"] == committed[str(m["txn"])], f"a message of an abandoned attempt was delivered: {m}"
    expected = {(p, t, i) for p in range(4) for t in range(TXNS) for i in range(transaction_size(p, t))}
    assert set(seen) == expected, "every committed message is delivered"
    assert all(n == 1 for n in seen.values()), "and exactly once"
    for key, seq in order.items():
        assert seq == sorted(seq), f"producer {key[0]} in {key[1]} is delivered in order"
