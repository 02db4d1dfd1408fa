#!/usr/bin/env python3
"""Consumer benchmark: one word-count shard (consume + store + publish downstream), exactly once.

A LocalCluster (etcd + 3 broker processes on loopback); the source journal holds --messages
committed messages {"word": w} (one of 1,000 words); one shard reads them committed, keeps each
word's count in its store and publishes the running count {"word", "n"} uncommitted downstream,
committing store, checkpoint and ACKs per transaction (max 1 s).

- --store sqlite: a SQLite file, SELECT + UPSERT per message.
- --store recorded: the same on a RecordedSQLiteStore (`sqlite_store`: every file write recorded to
  the shard's recovery log, R as the journals; a commit returns once the log holds it), after a
  handoff of the log as a promoted primary does.
- --store postgres: a private PostgreSQL server (fsync on), counts kept in the store's cache
  (loaded once per word) and the transaction's changed counts written in finalize_txn with one
  executemany (a round trip per message would bound it instead).

Prints JSON lines:

  consume            msgs_per_s through the shard, from its start to its read-through of the whole source
  commit_latency     the store commit (finalize, previous ACKs, commit), median and p99 ms
                     (while consuming the backlog: few, large transactions)
  end_to_end         one message published committed -> the shard's downstream message committed
                     (its transaction's ACKs written), median and p99 ms, --samples messages one by one
  commit_latency_small  the store commit of those one-message transactions, median and p99 ms

  bench/consumer.py --messages 200000 --replication 3 [--store recorded|postgres]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import tempfile
import time
from pathlib import Path

from _ab import main_if_requested
from _common import create_journal, emit, run

from tidings.client import AppendService, AsyncClient
from tidings.cluster import LocalCluster
from tidings.cluster.postgres import PostgresProcess
from tidings.consumer import Application, PostgresStore, Shard, SQLiteStore, serve_primary, sqlite_store
from tidings.consumer.recovery import CONTENT_TYPE
from tidings.consumer.recoverylog.ops import new_author
from tidings.consumer.recoverylog.player import Player
from tidings.consumer.recoverylog.recorder import Recorder
from tidings.message import Publisher
from tidings.protocol import protocol_pb2 as pb

COUNTS = "CREATE TABLE IF NOT EXISTS counts (word TEXT PRIMARY KEY, n INTEGER NOT NULL)"
WORDS = [f"w{i:04d}" for i in range(1000)]


class WordCount(Application):
    def __init__(self, path: str) -> None:
        self.path = path

    def new_store(self, shard: Shard) -> SQLiteStore:
        return SQLiteStore(self.path, schema=[COUNTS])

    async def consume_message(self, shard, store, env, publisher) -> None:
        word = env.message["word"]
        db = store.transaction()
        n = (db.execute("SELECT n FROM counts WHERE word = ?", (word,)).fetchone() or (0,))[0] + 1
        db.execute("INSERT INTO counts VALUES (?, ?) ON CONFLICT (word) DO UPDATE SET n = excluded.n", (word, n))
        await publisher.publish_uncommitted("bench/counts", {"word": word, "n": n})

    async def finalize_txn(self, shard, store, publisher) -> None:
        pass


class RecordedWordCount(WordCount):
    def new_store(self, shard: Shard) -> SQLiteStore:
        return sqlite_store(shard, schema=[COUNTS])


async def take_over(c: AsyncClient, shard: Shard, log: str, dir: str) -> None:
    """What a promoted primary does (consumer/recovery.py): play the log, hand it off, record on."""
    player = Player(c, pb.FSMHints(log=log), Path(dir))
    author = new_author()
    player.inject_handoff(author)
    played = await player.play()
    shard.recorder = Recorder(AppendService(c), log, played.fsm, author, played.write_head)
    shard.recovery_dir = Path(dir)


class CachedWordCount(Application):
    """The PostgreSQL variant: counts in `store.cache` (word -> n; changed words), written per transaction."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn

    def new_store(self, shard: Shard) -> PostgresStore:
        store = PostgresStore(self.dsn, schema=[COUNTS])
        store.cache = ({}, set())  # (the primary's own: a failed commit stops it, and the store with it)
        return store

    async def consume_message(self, shard, store, env, publisher) -> None:
        counts, changed = store.cache
        word = env.message["word"]
        n = counts.get(word)
        if n is None:
            cur = await store.transaction().execute("SELECT n FROM counts WHERE word = %s", (word,))
            n = ((await cur.fetchone()) or (0,))[0]
        counts[word] = n = n + 1
        changed.add(word)
        await publisher.publish_uncommitted("bench/counts", {"word": word, "n": n})

    async def finalize_txn(self, shard, store, publisher) -> None:
        counts, changed = store.cache
        async with store.transaction().cursor() as cur:
            await cur.executemany(
                "INSERT INTO counts VALUES (%s, %s) ON CONFLICT (word) DO UPDATE SET n = excluded.n",
                [(w, counts[w]) for w in changed],
            )
        changed.clear()


def ms(values: list[float], q: float) -> float:
    return round(1000 * statistics.quantiles(values, n=100)[int(q) - 1], 2) if len(values) > 1 else 0.0


async def bench(lc: LocalCluster, args: argparse.Namespace, work: str) -> None:
    endpoint = lc.brokers[0].endpoint
    async with AsyncClient(endpoint) as c:
        for name in ("bench/words", "bench/counts"):
            await create_journal(c, lc, name, args.replication)
        pub = Publisher(AppendService(c))
        rng = random.Random(1)
        for at in range(0, args.messages, 1000):
            batch = [{"word": rng.choice(WORDS)} for _ in range(min(1000, args.messages - at))]
            await pub.publish_committed("bench/words", *batch)
        await pub.service.flush()
        head = await c.write_head("bench/words")

        spec = pb.ShardSpec(
            id="bench/0", sources=[pb.ShardSpec.Source(journal="bench/words")], max_txn_duration_ms=1000
        )
        commits: list[float] = []
        shard = Shard(spec, c, on_transaction=lambda stats: commits.append(stats.committing))
        stop = asyncio.Event()
        app: Application = WordCount(f"{work}/bench.db")
        if args.store == "postgres":
            app = CachedWordCount(args.dsn)
        elif args.store == "recorded":
            log = "bench/logs/bench/0"
            await create_journal(c, lc, log, args.replication, labels={"content-type": CONTENT_TYPE})
            await take_over(c, shard, log, f"{work}/recorded")
            app = RecordedWordCount(f"{work}/recorded")
        t0 = time.perf_counter()
        task = asyncio.ensure_future(serve_primary(c, spec, app, stop, shard))
        await shard.wait_read_through({"bench/words": head}, timeout=600)
        took = time.perf_counter() - t0
        common = {"replicas": args.replication, "store": args.store, "payload_bytes": 60}
        if shard.recorder is not None:
            emit({"test": "recorded", "log_bytes": shard.recorder.statistics().bytes,
                  "ops": shard.recorder.statistics().ops}, **common)  # fmt: skip
        emit({"test": "consume", "messages": args.messages, "seconds": round(took, 2),
              "msgs_per_s": round(args.messages / took), "transactions": len(commits)}, **common)  # fmt: skip
        emit({"test": "commit_latency", "median_ms": ms(commits, 50), "p99_ms": ms(commits, 99),
              "transactions": len(commits)}, **common)  # fmt: skip

        e2e: list[float] = []
        before = len(commits)
        for _ in range(args.samples):
            t = time.perf_counter()
            spans = await (await pub.publish_committed("bench/words", {"word": rng.choice(WORDS)}))
            await shard.wait_read_through({"bench/words": spans[0].end}, timeout=60)
            e2e.append(time.perf_counter() - t)
        emit({"test": "end_to_end", "median_ms": ms(e2e, 50), "p99_ms": ms(e2e, 99), "samples": len(e2e)}, **common)
        small = commits[before:]
        emit({"test": "commit_latency_small", "median_ms": ms(small, 50), "p99_ms": ms(small, 99),
              "transactions": len(small)}, **common)  # fmt: skip
        stop.set()
        await task
        await pub.service.aclose()


def main() -> None:
    main_if_requested("consumer.py")  # (--ab REF: this tree against REF, interleaved; bench/_ab.py)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=200_000)
    ap.add_argument("--replication", type=int, default=3)
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--store", choices=["sqlite", "recorded", "postgres"], default="sqlite")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tidings-bench-consumer-") as work, contextlib.ExitStack() as stack:
        if args.store == "postgres":
            args.dsn = stack.enter_context(PostgresProcess(fsync=True)).dsn()
        lc = LocalCluster(brokers=3, zones=3, data_dir=work)
        try:
            lc.start()
            run(bench(lc, args, work))
        finally:
            lc.stop()


if __name__ == "__main__":
    main()
