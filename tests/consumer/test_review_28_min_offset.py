"""Review 28: ShardSpec.Source.min_offset lower-bounds where a source is read, as Gazette's
startReadingMessages does (`if offset < src.MinOffset { offset = src.MinOffset }`), also when the
checkpoint already has the journal: an operator raises it to skip a range (bad data, history not
wanted). tidings applies it only to a journal the checkpoint does not know, so the skipped range is
consumed anyway."""

from __future__ import annotations

import asyncio
from collections import Counter

from tests.consumer.test_shard import COUNTS, WordCount, produce, spec, stored_counts
from tests.support.waiting import wait_until
from tidings.consumer import SQLiteStore
from tidings.consumer.shard import serve_primary
from tidings.message import read_uncommitted


async def test_a_raised_min_offset_skips_what_lies_below_it(cluster, tmp_path) -> None:
    for name in ("wc/in", "wc/out"):
        await cluster.create_journal(name, 3)
    path = tmp_path / "wc-0.db"
    setup = SQLiteStore(path)  # (the counts table, before anyone polls it)
    setup.db.execute(COUNTS)
    setup.destroy()
    await produce(cluster, ["apple"] * 5)
    async with cluster.client() as c:
        stop = asyncio.Event()
        task = asyncio.ensure_future(serve_primary(c, spec(), WordCount(path), stop))
        await wait_until(lambda: stored_counts(path) == {"apple": 5}, 20)
        stop.set()
        await task
        await produce(cluster, ["poison"] * 5)  # the range the operator skips
        head = [env.end async for env in read_uncommitted(c, "wc/in", block=False)][-1]
        await produce(cluster, ["banana"] * 5)
        raised = spec()
        raised.sources[0].min_offset = head
        stop = asyncio.Event()
        task = asyncio.ensure_future(serve_primary(c, raised, WordCount(path), stop))
        await wait_until(lambda: stored_counts(path).get("banana") == 5 or task.done(), 20)
        stop.set()
        await asyncio.wait([task])
    assert stored_counts(path) == Counter(apple=5, banana=5)
