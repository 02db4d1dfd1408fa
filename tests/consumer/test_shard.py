"""A consumer shard's transactions commit exactly once (DESIGN.md invariant 8): word counts in its
store and a downstream journal of running counts stay exact through crashes at random points of
transactions, in the store's commit and between it and the ACKs, and through a zombie primary racing
its successor. Real brokers (in-process), a real SQLite file or a real PostgreSQL database (the crash
and zombie tests run on both stores); the shard runs as a task, crashed by cancelling it (its store's
open transaction is then lost, as in a kill -9: see tests/consumer/test_store.py)."""

from __future__ import annotations

import asyncio
import random
import sys
import threading
from collections import Counter, defaultdict

import apsw
import psycopg
import pytest

from tests.support.waiting import wait_until
from tidings.consumer import Application, PostgresStore, Shard, SQLiteStore, serve_primary
from tidings.message import Publisher, read_committed, read_uncommitted
from tidings.protocol import protocol_pb2 as pb

COUNTS = "CREATE TABLE IF NOT EXISTS counts (word TEXT PRIMARY KEY, n INTEGER NOT NULL)"
WORDS = ["apple", "banana", "cherry", "date", "elder", "fig", "grape"]


def is_postgres(where) -> bool:
    """Where a WordCount keeps its counts: a PostgreSQL URL, else a SQLite file's path."""
    return str(where).startswith("postgresql://")


class WordCount(Application):
    """The application: count each word in the store, publish its running count downstream."""

    def __init__(self, path, on_message=None) -> None:
        self.path, self.on_message, self.consumed = path, on_message, 0

    def new_store(self, shard) -> SQLiteStore | PostgresStore:
        if is_postgres(self.path):
            return PostgresStore(str(self.path), schema=[COUNTS])
        return SQLiteStore(self.path, schema=[COUNTS])

    async def consume_message(self, shard, store, env, publisher) -> None:
        word = env.message["word"]
        if isinstance(store, PostgresStore):
            cur = await store.transaction().execute(
                "INSERT INTO counts VALUES (%s, 1) ON CONFLICT (word) DO UPDATE SET n = counts.n + 1 RETURNING n",
                (word,),
            )
            (n,) = await cur.fetchone()
        else:
            db = store.transaction()
            n = (db.execute("SELECT n FROM counts WHERE word = ?", (word,)).fetchone() or (0,))[0] + 1
            db.execute("INSERT INTO counts VALUES (?, ?) ON CONFLICT (word) DO UPDATE SET n = excluded.n", (word, n))
        await publisher.publish_uncommitted("wc/out", {"word": word, "n": n})
        self.consumed += 1
        if self.on_message is not None:
            self.on_message(self.consumed)

    async def finalize_txn(self, shard, store, publisher) -> None:
        pass


def spec() -> pb.ShardSpec:
    return pb.ShardSpec(
        id="wc/0", sources=[pb.ShardSpec.Source(journal="wc/in")], max_txn_duration_ms=200, min_txn_duration_ms=0
    )


async def produce(cluster, words: list[str]) -> None:
    from tidings.client import AppendService

    async with cluster.client() as c:
        pub = Publisher(AppendService(c))
        for i in range(0, len(words), 25):
            await (await pub.publish_committed("wc/in", *({"word": w} for w in words[i : i + 25])))
        await pub.service.aclose()


def _query(where, sql: str) -> list[tuple]:
    """Rows of a query on the committed state of a WordCount's store (none if its table is not there yet)."""
    if is_postgres(where):
        with psycopg.connect(str(where)) as conn:
            try:
                return conn.execute(sql).fetchall()
            except psycopg.errors.UndefinedTable:
                return []
    store = SQLiteStore(where)
    try:
        return store.db.execute(sql).fetchall()
    except apsw.SQLError as exc:
        if "no such table" in str(exc):
            return []
        raise
    finally:
        store.destroy()


def read_through(path) -> int:
    """The read-through offset of wc/in in the committed checkpoint (0 before any)."""
    rows = _query(path, "SELECT checkpoint FROM tidings_checkpoints WHERE shard = 'wc/0'")
    cp = pb.Checkpoint()
    if rows:
        cp.ParseFromString(bytes(rows[0][0]))
    return cp.sources["wc/in"].read_through if "wc/in" in cp.sources else 0


def stored_counts(path) -> dict[str, int]:
    return dict(_query(path, "SELECT word, n FROM counts"))  # type: ignore[arg-type]


@pytest.fixture(params=["sqlite", "postgres"])
def where(request, tmp_path):
    """A WordCount's store: a SQLite file, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return tmp_path / "wc-0.db"
    return request.getfixturevalue("pg_dsn")


async def crash_at_random_points(c, shard_spec, path, rng, crashes: int, fewest: int, most: int) -> None:
    """Run the shard `crashes` times, each crashed (cancelled) after a random number of messages in
    [fewest, most), mid-transaction."""
    for _crash in range(crashes):
        at = rng.randrange(fewest, most)
        crashed = asyncio.Event()
        app = WordCount(path, lambda n, at=at, crashed=crashed: crashed.set() if n >= at else None)
        task = asyncio.ensure_future(serve_primary(c, shard_spec, app, asyncio.Event()))
        await asyncio.wait([task, asyncio.ensure_future(crashed.wait())], return_when=asyncio.FIRST_COMPLETED)
        task.cancel()
        await asyncio.wait([task])


async def check_downstream(cluster, expected: Counter) -> None:
    """Each word's running counts appear downstream exactly once each, in order: 1, 2, ..., its total."""
    seen: dict[str, list[int]] = defaultdict(list)
    async with cluster.client() as c:
        async for env in read_committed(c, "wc/out", block=False):
            seen[env.message["word"]].append(env.message["n"])
    assert {w: ns for w, ns in seen.items()} == {w: list(range(1, n + 1)) for w, n in expected.items()}


async def test_word_counts_are_exact_through_crashes_at_random_points(cluster, where) -> None:
    for name in ("wc/in", "wc/out"):
        await cluster.create_journal(name, 3)
    rng = random.Random(20261124)
    words = [rng.choice(WORDS) for _ in range(400)]
    producing = asyncio.ensure_future(produce(cluster, words))
    path = where
    async with cluster.client() as c:
        await crash_at_random_points(c, spec(), path, rng, 4, 20, 120)
        stop = asyncio.Event()
        task = asyncio.ensure_future(serve_primary(c, spec(), WordCount(path), stop))
        await producing
        await wait_until(lambda: sum(stored_counts(path).values()) == len(words), 60)
        stop.set()
        await task
    assert stored_counts(path) == Counter(words)
    await check_downstream(cluster, Counter(words))


ZOMBIE = """
import asyncio, sys
from tests.consumer.test_shard import WordCount, spec
from tidings.client import AsyncClient
from tidings.consumer import FenceError, Shard, serve_primary

async def main(endpoint, path):
    async with AsyncClient(endpoint) as c:
        app = WordCount(path, lambda n: print("consumed", n, flush=True) if n == 50 else None)
        try:
            await serve_primary(c, spec(), app, asyncio.Event())
        except FenceError as exc:
            print("fenced:", exc, flush=True)
            sys.exit(3)

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


async def test_a_zombie_primary_stops_at_its_next_commit_and_nothing_is_doubled(cluster, where) -> None:
    """The zombie is another process (two primaries of one shard never share a process), still
    consuming when its successor restores the store (SQLite: fenced at its next commit; PostgreSQL:
    its transaction in progress commits before the restore, its next begin is fenced)."""
    for name in ("wc/in", "wc/out"):
        await cluster.create_journal(name, 3)
    rng = random.Random(7)
    words: list[str] = []
    fenced = asyncio.Event()

    async def keep_producing() -> None:
        """Input keeps coming until the zombie is fenced: an idle zombie never commits, so never learns."""
        while not fenced.is_set():
            batch = [rng.choice(WORDS) for _ in range(10)]
            words.extend(batch)
            await produce(cluster, batch)

    path = where
    zombie = await asyncio.create_subprocess_exec(
        sys.executable, "-c", ZOMBIE, cluster.brokers[0].endpoint, str(path), stdout=asyncio.subprocess.PIPE
    )
    try:
        producing = asyncio.ensure_future(keep_producing())
        assert zombie.stdout is not None
        assert await asyncio.wait_for(zombie.stdout.readline(), 60) == b"consumed 50\n"
        async with cluster.client() as c:
            stop = asyncio.Event()
            successor = asyncio.ensure_future(serve_primary(c, spec(), WordCount(path), stop))  # (the zombie runs on)
            said = await asyncio.wait_for(zombie.stdout.readline(), 60)
            assert said.startswith(b"fenced: ") and await asyncio.wait_for(zombie.wait(), 30) == 3, said
            fenced.set()
            await producing
            await wait_until(lambda: sum(stored_counts(path).values()) == len(words), 60)
            stop.set()
            await successor
    finally:
        if zombie.returncode is None:
            zombie.kill()
            await zombie.wait()
    assert stored_counts(path) == Counter(words)
    await check_downstream(cluster, Counter(words))


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
    """A shard cancelled (stopped, or crashed) while its store's commit runs in the worker thread
    loses nothing: the checkpoint (read-through, ACK intents) lands with that transaction's changes or
    not at all. (Cancelling `asyncio.to_thread` does not stop the thread: a ROLLBACK on the loop's
    thread under it would let the worker's UPDATE commit the checkpoint alone, and the next primary
    would resume after inputs whose effects are not in the store while their downstream messages get
    ACKed from the recovered intents.)

    The disk is made slow for the one commit with a gate the worker waits on (fault injection widening
    the window; the gate opens once the loop thread rolled back, if it does), and the application's
    `finished_txn` (awaited as the commit starts, with its future) waits for the commit: an async hook
    may await."""
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
    """A primary that dies right after its store commit, before writing the transaction's ACKs (the
    store's commit is followed by a wait that never ends; the task is then cancelled), and a successor
    that dies while re-writing the recovered ACK intents: the third primary still commits every word
    once, and downstream readers (read committed) see each running count once, in order."""
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


async def _transactions_of(cluster, tmp_path, disable_wait_for_ack: bool) -> list[int]:
    """Messages per shard transaction when a committed word arrives with another producer's open
    transaction (its ACK written once the shard consumed the first word)."""
    from tidings.client import AppendService

    for name in ("wc/in", "wc/out"):
        await cluster.create_journal(name, 1)
    sizes: list[int] = []
    consumed = asyncio.Event()
    shard_spec = spec()
    shard_spec.max_txn_duration_ms, shard_spec.disable_wait_for_ack = 60_000, disable_wait_for_ack
    async with cluster.client() as c:
        pub = Publisher(AppendService(c))
        await (await pub.publish_uncommitted("wc/in", {"word": "apple"}))
        await produce(cluster, ["banana"])
        stop = asyncio.Event()
        shard = Shard(shard_spec, c, on_transaction=lambda stats: sizes.append(stats.messages))
        app = WordCount(tmp_path / "wc-0.db", lambda n: consumed.set())
        task = asyncio.ensure_future(serve_primary(c, shard_spec, app, stop, shard))
        await asyncio.wait_for(consumed.wait(), 30)  # banana (apple is pending)
        if disable_wait_for_ack:
            await wait_until(lambda: sizes == [1], 30)
        await (await pub.write_ack_intents(pub.build_ack_intents()))
        await wait_until(lambda: sum(sizes) == 2, 30)
        stop.set()
        await task
        await pub.service.aclose()
    assert stored_counts(tmp_path / "wc-0.db") == {"apple": 1, "banana": 1}
    return sizes


async def test_a_transaction_waits_for_the_ack_of_a_source_transaction_it_saw_begin(cluster, tmp_path) -> None:
    assert await _transactions_of(cluster, tmp_path, disable_wait_for_ack=False) == [2]


async def test_disable_wait_for_ack_closes_at_once(cluster, tmp_path) -> None:
    assert await _transactions_of(cluster, tmp_path, disable_wait_for_ack=True) == [1, 1]


async def test_read_through_follows_chunks_that_deliver_nothing(cluster, tmp_path) -> None:
    """Stat's wait: offsets reached by a message that commits nothing (a pending one) count as read."""
    from tidings.client import AppendService

    for name in ("wc/in", "wc/out"):
        await cluster.create_journal(name, 1)
    await produce(cluster, ["apple", "banana"])
    async with cluster.client() as c:
        stop = asyncio.Event()
        shard = Shard(spec(), c)
        task = asyncio.ensure_future(serve_primary(c, spec(), WordCount(tmp_path / "wc-0.db"), stop, shard))
        pub = Publisher(AppendService(c))
        pending = await (await pub.publish_uncommitted("wc/in", {"word": "cherry"}))
        through = await shard.wait_read_through({"wc/in": pending[0].end}, timeout=30)
        assert through["wc/in"] >= pending[0].end
        stop.set()
        await task
        await pub.service.aclose()
    assert stored_counts(tmp_path / "wc-0.db") == {"apple": 1, "banana": 1}


class SyncCounts(Application):
    """The sync variant of the application API: plain functions throughout (it only changes its store)."""

    def __init__(self, path) -> None:
        self.path, self.hooks = path, Counter()

    def new_store(self, shard) -> SQLiteStore:
        return SQLiteStore(self.path, schema=[COUNTS])

    def begin_txn(self, shard, store) -> None:
        self.hooks["begin"] += 1

    def consume_message(self, shard, store, env, publisher) -> None:
        store.transaction().execute(
            "INSERT INTO counts VALUES (?, 1) ON CONFLICT (word) DO UPDATE SET n = n + 1", (env.message["word"],)
        )

    def finalize_txn(self, shard, store, publisher) -> None:
        self.hooks["finalize"] += 1

    def finished_txn(self, shard, store, future) -> None:
        self.hooks["finished"] += 1


async def test_an_application_of_plain_functions_runs_as_the_async_one(cluster, tmp_path) -> None:
    await cluster.create_journal("wc/in", 3)
    words = [WORDS[i % len(WORDS)] for i in range(100)]
    await produce(cluster, words)
    path, stop = tmp_path / "sync.db", asyncio.Event()
    app = SyncCounts(path)
    async with cluster.client() as c:
        task = asyncio.ensure_future(serve_primary(c, spec(), app, stop))
        await wait_until(lambda: sum(stored_counts(path).values()) == len(words), 60)
        stop.set()
        await task
    assert stored_counts(path) == Counter(words)
    assert app.hooks["begin"] == app.hooks["finalize"] == app.hooks["finished"] >= 1
