"""Review 28: a primary that dies right after its store commit, before writing the transaction's
ACKs (the store's commit is followed by a wait that never ends; the task is then cancelled), and a
successor that dies while re-writing the recovered intents: the third primary still commits every
word once, and downstream readers (read committed) see each running count once, in order."""

from __future__ import annotations

import asyncio
from collections import Counter

from tests.consumer.test_shard import WordCount, check_downstream, produce, spec, stored_counts
from tests.support.waiting import wait_until
from tidings.consumer import SQLiteStore
from tidings.consumer.shard import serve_primary


class DiesAfterCommit(SQLiteStore):
    def __init__(self, path, committed: asyncio.Event) -> None:
        super().__init__(path)
        self.committed = committed

    async def start_commit(self, shard, checkpoint, wait_for=()) -> None:
        await super().start_commit(shard, checkpoint, wait_for)
        self.committed.set()
        await asyncio.Event().wait()  # (the process dies here: cancelled below)


class Restored(SQLiteStore):
    """Says when its checkpoint is restored: the shard's next step re-writes the recovered ACK intents."""

    def __init__(self, path, restored: asyncio.Event) -> None:
        super().__init__(path)
        self.restored = restored

    async def restore_checkpoint(self, shard):
        checkpoint = await super().restore_checkpoint(shard)
        self.restored.set()
        return checkpoint


class Successor(WordCount):
    def __init__(self, path, restored: asyncio.Event) -> None:
        super().__init__(path)
        self.restored = restored

    def new_store(self, shard) -> SQLiteStore:
        store = Restored(self.path, self.restored)
        store.db.execute("CREATE TABLE IF NOT EXISTS counts (word TEXT PRIMARY KEY, n INTEGER NOT NULL)")
        return store


class App(WordCount):
    def __init__(self, path, committed: asyncio.Event) -> None:
        super().__init__(path)
        self.committed = committed

    def new_store(self, shard) -> SQLiteStore:
        store = DiesAfterCommit(self.path, self.committed)
        store.db.execute("CREATE TABLE IF NOT EXISTS counts (word TEXT PRIMARY KEY, n INTEGER NOT NULL)")
        return store


async def test_crash_between_the_store_commit_and_the_acks(cluster, tmp_path) -> None:
    for name in ("wc/in", "wc/out"):
        await cluster.create_journal(name, 3)
    words = ["apple", "banana", "cherry", "apple"] * 10
    await produce(cluster, words)
    path = tmp_path / "wc-0.db"
    async with cluster.client() as c:
        committed = asyncio.Event()
        task = asyncio.ensure_future(serve_primary(c, spec(), App(path, committed), asyncio.Event()))
        await asyncio.wait([task, asyncio.ensure_future(committed.wait())], return_when=asyncio.FIRST_COMPLETED)
        task.cancel()
        await asyncio.wait([task])
        # A second primary crashes mid re-write of the recovered intents (cancelled once it restored).
        restored = asyncio.Event()
        task = asyncio.ensure_future(serve_primary(c, spec(), Successor(path, restored), asyncio.Event()))
        await asyncio.wait([task, asyncio.ensure_future(restored.wait())], return_when=asyncio.FIRST_COMPLETED)
        task.cancel()
        await asyncio.wait([task])
        stop = asyncio.Event()
        task = asyncio.ensure_future(serve_primary(c, spec(), WordCount(path), stop))
        try:
            await wait_until(lambda: sum(stored_counts(path).values()) >= len(words) or task.done(), 30)
        finally:
            stop.set()
            await asyncio.wait([task])
    assert stored_counts(path) == Counter(words)
    await check_downstream(cluster, Counter(words))
