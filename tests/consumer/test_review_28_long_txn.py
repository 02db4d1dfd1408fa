"""Review 28: a source journal whose upstream transaction spans many of the shard's transactions
(its messages interleaved with another producer's committed ones), a small Sequencer ring (the
commit is replayed), and the shard crashed (cancelled) at points across it: every word counts
exactly once, downstream running counts once each in order."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

from tests.consumer.test_shard import WordCount, check_downstream, crash_at_random_points, read_through, stored_counts
from tests.support.waiting import wait_until
from tidings.client import AppendService
from tidings.consumer.shard import serve_primary
from tidings.message import Publisher
from tidings.protocol import protocol_pb2 as pb

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
