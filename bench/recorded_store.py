#!/usr/bin/env python3
"""A shard's store, plain vs recorded: transactions per second of `SQLiteStore` (a file, fsynced at
each commit) and of `RecordedSQLiteStore` (every file write recorded to a recovery log on a local
cluster of 3 brokers, R=3; a commit returns once the log holds it), and what the recorded one costs
to play back (log bytes written, bytes a hinted playback reads, its seconds).

Each transaction counts `--rows` words (upserts of ~200-byte rows over `--keys` keys), as a word
count's store does. Prints JSON lines.

  bench/recorded_store.py                    # 2,000 transactions of 20 rows
  bench/recorded_store.py --txns 5000 --rows 100 --keys 20000
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from _common import create_journal, emit, run

from tidings.client import AppendService, AsyncClient
from tidings.cluster import LocalCluster
from tidings.consumer import SQLiteStore
from tidings.consumer.recoverylog.ops import new_author
from tidings.consumer.recoverylog.player import Player
from tidings.consumer.recoverylog.recorder import Recorder
from tidings.consumer.store_recorded import RecordedSQLiteStore
from tidings.protocol import protocol_pb2 as pb

LOG = "bench/recovery/shard-0"
SCHEMA = "CREATE TABLE IF NOT EXISTS counts (word TEXT PRIMARY KEY, n INTEGER NOT NULL)"
UPSERT = "INSERT INTO counts VALUES (?, 1) ON CONFLICT (word) DO UPDATE SET n = n + 1"


async def transactions(store: SQLiteStore, args: argparse.Namespace) -> float:
    await store.restore_checkpoint("bench/0")
    pad = "x" * 200
    start = time.perf_counter()
    for i in range(args.txns):
        await store.begin()
        db = store.transaction()
        for j in range(args.rows):
            db.execute(UPSERT, (f"w{(i * 7919 + j * 104729) % args.keys}{pad}",))
        await store.start_commit("bench/0", pb.Checkpoint())
    return time.perf_counter() - start


async def main_async(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="tidings-bench-") as tmp:
        work = Path(tmp)
        plain = SQLiteStore(work / "plain.db", schema=[SCHEMA])
        seconds = await transactions(plain, args)
        plain.destroy()
        emit({"test": "store_plain_sqlite", "txns": args.txns, "rows": args.rows,
              "txns_per_s": round(args.txns / seconds), "seconds": round(seconds, 2)})  # fmt: skip

        lc = LocalCluster(brokers=3, zones=3, data_dir=work / "cluster")
        lc.extra = ["--log-level", "warning"]
        with lc:
            async with AsyncClient(lc.endpoints[0]) as c:
                await create_journal(c, lc, LOG, 3, labels={"content-type": "application/x-recoverylog"})
                player = Player(c, pb.FSMHints(log=LOG), work / "a")
                author = new_author()
                player.inject_handoff(author)
                played = await player.play()
                recorder = Recorder(AppendService(c), LOG, played.fsm, author, played.write_head)
                store = RecordedSQLiteStore(recorder, work / "a", schema=[SCHEMA])
                seconds = await transactions(store, args)
                hints = await recorder.build_hints()
                live = sum(p.stat().st_size for p in (work / "a").iterdir() if p.is_file())
                log_bytes = await c.write_head(LOG)
                emit({"test": "store_recorded_sqlite", "txns": args.txns, "rows": args.rows, "replicas": 3,
                      "txns_per_s": round(args.txns / seconds), "seconds": round(seconds, 2),
                      "log_bytes": log_bytes, "live_bytes": live, "rollovers": store.rollovers})  # fmt: skip
                store.destroy()
                start = time.perf_counter()
                again = Player(c, hints, work / "b")
                again.finish_at_write_head()
                await again.play()
                emit({"test": "store_recorded_playback", "live_bytes": live, "log_bytes": log_bytes,
                      "bytes_read": again.statistics().bytes_read,
                      "seconds": round(time.perf_counter() - start, 2)})  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--txns", type=int, default=2000)
    p.add_argument("--rows", type=int, default=20)
    p.add_argument("--keys", type=int, default=5000)
    run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
