"""Review 28: a shard cancelled (stopped, or crashed as the other tests crash it) while its store's
commit runs in the worker thread. `SQLiteStore.start_commit` rolls back on the event loop's thread
while `_commit` still runs in the worker (cancelling `asyncio.to_thread` does not stop the thread),
so the worker's UPDATE of the checkpoint can run in autocommit mode after the ROLLBACK: the
checkpoint (read-through, ACK intents) lands without the application's changes of that
transaction. The next primary resumes after inputs whose effects are not in the store (LOSS) while
their downstream messages get ACKed from the recovered intents.

The disk is made slow for the one commit with a gate the worker waits on (fault injection widening
the window; the gate opens once the loop thread rolled back), and the application's `finished_txn`
(awaited as the commit starts, with its future) waits for the commit: an async hook may await."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

from tests.consumer.test_shard import WordCount, check_downstream, produce, read_through, spec, stored_counts
from tests.support.waiting import wait_until
from tidings.consumer import SQLiteStore
from tidings.consumer.shard import serve_primary
from tidings.message import read_uncommitted


class SlowDiskStore(SQLiteStore):
    """A SQLiteStore whose first commit waits in its worker thread until the loop thread rolled back."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self.entered, self.gate, self.worker_done = threading.Event(), threading.Event(), threading.Event()
        self.worker_error: BaseException | None = None
        self.slow = True

    def _commit(self, shard: str, raw: bytes) -> None:
        if not self.slow:
            return super()._commit(shard, raw)
        self.slow = False
        self.entered.set()
        self.gate.wait(10)
        try:
            super()._commit(shard, raw)
        except BaseException as exc:
            self.worker_error = exc
        finally:
            self.worker_done.set()

    def _rollback(self) -> None:
        super()._rollback()
        self.gate.set()


class SlowDiskWordCount(WordCount):
    def __init__(self, path) -> None:
        super().__init__(path)
        self.store: SlowDiskStore | None = None

    def new_store(self, shard) -> SlowDiskStore:
        store = self.store = SlowDiskStore(self.path)
        store.db.execute("CREATE TABLE IF NOT EXISTS counts (word TEXT PRIMARY KEY, n INTEGER NOT NULL)")
        return store

    async def finished_txn(self, shard, store, commit) -> None:
        await asyncio.wait([commit])  # (e.g. flushing metrics once committed: an async hook awaits)
        if commit.cancelled() or commit.exception() is not None:
            await asyncio.to_thread(store.worker_done.wait, 10)


async def test_cancel_during_the_store_commit_loses_nothing(cluster, tmp_path) -> None:
    for name in ("wc/in", "wc/out"):
        await cluster.create_journal(name, 3)
    words = ["apple", "banana", "cherry"] * 10
    await produce(cluster, words)
    async with cluster.client() as c:
        head = [env.end async for env in read_uncommitted(c, "wc/in", block=False)][-1]
    path = tmp_path / "wc-0.db"
    async with cluster.client() as c:
        app = SlowDiskWordCount(path)
        task = asyncio.ensure_future(serve_primary(c, spec(), app, asyncio.Event()))
        await wait_until(lambda: app.store is not None and app.store.entered.is_set(), 30)
        task.cancel()  # the shard is stopped (or crashes) while its commit is on the disk
        await asyncio.wait([task])
        stop = asyncio.Event()
        successor = asyncio.ensure_future(serve_primary(c, spec(), WordCount(path), stop))
        try:
            await wait_until(lambda: read_through(path) >= head or successor.done(), 30)
        finally:
            stop.set()
            await asyncio.wait([successor])
    # Whatever the first primary's commit did, every word counts exactly once.
    assert stored_counts(path) == Counter(words), f"worker thread saw: {app.store.worker_error!r}"
    await check_downstream(cluster, Counter(words))
