#!/usr/bin/env python3
"""Spark batch reads of a journal (local[2]) beside `spark.read.json` on the same bytes in a file.

Starts a cluster (private etcd + 3 brokers), publishes `--messages` committed 200-byte JSON
messages to one journal (R=3), then times, `--rounds` times each and interleaved, a query that
decodes every row (count, sum and max over the fields) through the tidings source (read
committed, and read uncommitted) and through Spark's own JSON reader on a file holding the
journal's bytes. The journal has 8 MiB fragments, so the source reads it in partitions of whole
fragments (two of 1M messages' 195 MB, as Spark splits the file), read committed also in one; and,
to show where the time goes, the raw bytes of each message (format raw: no JSON decoded, no UUID
looked at) beside `spark.read.text`. A `spark_batch_plan` line per reader gives the seconds Spark
takes to plan its partitions (read committed, the driver's UUID scan up to each cut).
Prints one JSON line per round and a summary line per reader (best round).

  bench/spark.py                          # 1M messages, 3 rounds (~2 min)
  bench/spark.py --messages 200000 --rounds 1
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

from _ab import main_if_requested
from _common import create_journal, emit

from tidings.client import AppendService, AsyncClient, Client
from tidings.cluster import LocalCluster
from tidings.message import Publisher
from tidings.spark.local import local_session

SCHEMA = "id BIGINT, user STRING, amount DOUBLE, note STRING"
JOURNAL = "bench/spark"


async def fill(lc: LocalCluster, n: int, fragment: str = "8MiB") -> None:
    async with AsyncClient(lc.endpoints[0]) as c:
        await create_journal(c, lc, JOURNAL, 3, {"content-type": "application/x-ndjson"}, fragment)
        service = AppendService(c)
        pub = Publisher(service)
        note = "x" * 90  # with the uuid field, about 200 bytes a line
        for at in range(0, n, 10_000):
            msgs = [
                {"id": i, "user": f"user-{i % 1000}", "amount": i * 0.25, "note": note}
                for i in range(at, min(n, at + 10_000))
            ]
            await (await pub.publish_committed(JOURNAL, *msgs))
        await service.aclose()


def timed(make) -> tuple[float, float, int]:  # type: ignore[no-untyped-def]
    """Seconds to build the DataFrame (Spark plans the source's partitions there: the driver's scan)
    and run the query, the first of them, and the rows counted."""
    from pyspark.sql import functions as F

    t = time.perf_counter()
    df = make()
    planned = time.perf_counter() - t
    if "value" in df.columns:  # (raw bytes: a line each)
        row = df.agg(F.count("*").alias("n"), F.max(F.length("value"))).collect()[0]
    else:
        row = df.agg(F.count("*").alias("n"), F.sum("amount"), F.max("id"), F.max("user"), F.max("note")).collect()[0]
    return time.perf_counter() - t, planned, row["n"]


def main() -> None:
    main_if_requested("spark.py")  # (--ab REF: this tree against REF, interleaved; bench/_ab.py)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--messages", type=int, default=1_000_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--fragment", default="8MiB", help="the journal's fragment length (splits fall between fragments)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="tidings-bench-") as tmp:
        lc = LocalCluster(brokers=3, zones=3, data_dir=tmp)
        lc.extra = ["--log-level", "warning"]
        with lc:
            asyncio.run(fill(lc, args.messages, args.fragment))
            path = os.path.join(tmp, "journal.ndjson")
            with Client(lc.endpoints[0]) as c, open(path, "wb") as f:
                for chunk in c.read(JOURNAL):
                    f.write(chunk.content)
            size = os.path.getsize(path)
            with local_session("tidings-bench") as spark:
                measure(spark, lc, path, size, args)


def measure(spark, lc: LocalCluster, path: str, size: int, args: argparse.Namespace) -> None:  # type: ignore[no-untyped-def]
    def base():  # type: ignore[no-untyped-def]  # (a new reader each time: option() changes the reader it is called on)
        return spark.read.format("tidings").option("broker", lc.endpoints[0]).option("journal", JOURNAL)

    readers = {
        "tidings_committed": lambda: base().schema(SCHEMA).load(),
        "tidings_committed_one_partition": lambda: base().option("bytesPerPartition", 2 * size).schema(SCHEMA).load(),
        "tidings_uncommitted": lambda: base().option("readCommitted", "false").schema(SCHEMA).load(),
        "tidings_raw": lambda: base().option("format", "raw").option("readCommitted", "false").load(),
        "spark_read_json": lambda: spark.read.schema(SCHEMA).json(path),
        "spark_read_text": lambda: spark.read.text(path),
    }
    for name, make in readers.items():
        timed(make)  # warm up: the session, Python workers
        t = time.perf_counter()
        parts = make().rdd.getNumPartitions()  # (plans the source's partitions: the driver's scan, read committed)
        emit({"test": "spark_batch_plan", "reader": name, "partitions": parts,
              "seconds": round(time.perf_counter() - t, 3)})  # fmt: skip
    results: dict[str, list[float]] = {k: [] for k in readers}
    for r in range(args.rounds):
        for name, make in readers.items():
            seconds, planned, rows = timed(make)
            assert rows == args.messages, (name, rows)
            results[name].append(seconds)
            emit({"test": "spark_batch_read", "reader": name, "round": r, "rows": rows,
                  "seconds": round(seconds, 3), "planning_seconds": round(planned, 3),
                  "rows_per_s": round(rows / seconds),
                  "mb_per_s": round(size / seconds / 1e6, 1)})  # fmt: skip
    for name, secs in results.items():
        best = min(secs)
        emit({"test": "spark_batch_read_best", "reader": name, "rows": args.messages,
              "rows_per_s": round(args.messages / best),
              "median_rows_per_s": round(args.messages / statistics.median(secs)),
              "bytes": size, "master": "local[2]"})  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
