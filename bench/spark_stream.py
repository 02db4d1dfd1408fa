#!/usr/bin/env python3
"""Structured Streaming through tidings, end to end: publish -> source -> query -> exactly-once sink.

Starts a cluster (private etcd + 3 brokers), an input and a sink journal (R=3), and a streaming
query on local[2] that reads the input committed and writes each row to the sink (the default
trigger: a micro-batch as soon as the last one ends). Then two phases:

* latency: producers publish committed transactions of `--txn` messages at `--rate` messages/s,
  each carrying its publish time; a reader of the sink (read committed, blocking) records, for
  every row, the time it became readable there minus its publish time. Prints p50/p90/p99/max.
* throughput: `--backlog` messages are published at once (as fast as the publisher goes); prints
  the rows/s at which they appear in the sink, read committed.

  bench/spark_stream.py                       # ~1.5 min
  bench/spark_stream.py --rate 500 --seconds 20 --backlog 100000
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
import time

from _common import create_journal, emit

from tidings.client import AppendService, AsyncClient, Client
from tidings.cluster import LocalCluster
from tidings.message import Publisher, ReadCommitted
from tidings.spark.local import local_session

IN, OUT = "bench/stream-in", "bench/stream-out"
NDJSON = {"content-type": "application/x-ndjson"}


class SinkWatch(threading.Thread):
    """Reads the sink journal committed (blocking) and notes when each row became readable."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(daemon=True)
        self.endpoint = endpoint
        self.seen: dict[int, tuple[float, float]] = {}  # id -> (sent, seen)
        self.stop = False

    def run(self) -> None:
        with Client(self.endpoint) as c:
            for batch in ReadCommitted(c, OUT).batches():
                now = time.time()
                for env in batch:
                    msg = env.message
                    if "id" in msg:
                        self.seen.setdefault(msg["id"], (msg["sent"], now))
                if self.stop:
                    return

    def wait_for(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.seen) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the sink holds {len(self.seen)} of {n} rows after {timeout} s")
            time.sleep(0.05)


async def publish(endpoint: str, first: int, n: int, rate: float | None, txn: int) -> None:
    """Publish ids [first, first + n) in committed transactions of `txn`, at `rate` messages/s (None: at once)."""
    async with AsyncClient(endpoint) as c:
        service = AppendService(c)
        pub = Publisher(service)
        start = time.monotonic()
        for at in range(first, first + n, txn):
            if rate is not None:
                await asyncio.sleep(max(0.0, start + (at - first) / rate - time.monotonic()))
            msgs = [{"id": i, "sent": time.time()} for i in range(at, min(first + n, at + txn))]
            await (await pub.publish_committed(IN, *msgs))
        await service.aclose()


async def make_journals(lc: LocalCluster) -> None:
    async with AsyncClient(lc.endpoints[0]) as c:
        for name in (IN, OUT):
            await create_journal(c, lc, name, 3, NDJSON)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=1000.0, help="latency phase: messages published per second")
    p.add_argument("--seconds", type=float, default=30.0, help="latency phase: how long to publish")
    p.add_argument("--txn", type=int, default=10, help="messages per transaction")
    p.add_argument("--backlog", type=int, default=200_000, help="throughput phase: messages published at once")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="tidings-bench-") as tmp:
        lc = LocalCluster(brokers=3, zones=3, data_dir=tmp)
        lc.extra = ["--log-level", "warning"]
        with lc, local_session("tidings-bench-stream") as spark:
            asyncio.run(make_journals(lc))
            ep = lc.endpoints[0]
            query = (
                spark.readStream.format("tidings")
                .option("broker", ep)
                .option("journal", IN)
                .option("schema", "id BIGINT, sent DOUBLE")
                .load()
                .select("id", "sent")
                .writeStream.format("tidings")
                .option("broker", ep)
                .option("journal", OUT)
                .option("checkpointLocation", f"{tmp}/checkpoint")
                .start()
            )
            watch = SinkWatch(ep)
            watch.start()
            try:
                asyncio.run(publish(ep, 0, 100, None, args.txn))  # warm up: the first batches start workers
                watch.wait_for(100, 120)
                n = int(args.rate * args.seconds)
                asyncio.run(publish(ep, 100, n, args.rate, args.txn))
                watch.wait_for(100 + n, 120)
                lat = sorted(seen - sent for i, (sent, seen) in watch.seen.items() if i >= 100)
                q = statistics.quantiles(lat, n=100)
                emit({"test": "spark_stream_latency", "rate": args.rate, "txn": args.txn, "messages": n,
                      "p50_ms": round(q[49] * 1e3, 1), "p90_ms": round(q[89] * 1e3, 1),
                      "p99_ms": round(q[98] * 1e3, 1), "max_ms": round(lat[-1] * 1e3, 1),
                      "master": "local[2]"})  # fmt: skip
                first = 100 + n
                t = time.monotonic()
                asyncio.run(publish(ep, first, args.backlog, None, max(args.txn, 1000)))
                published = time.monotonic() - t
                watch.wait_for(first + args.backlog, 600)
                done = max(seen for i, (_sent, seen) in watch.seen.items() if i >= first)
                began = min(sent for i, (sent, _seen) in watch.seen.items() if i >= first)
                emit({"test": "spark_stream_throughput", "messages": args.backlog,
                      "publish_s": round(published, 2), "end_to_end_s": round(done - began, 2),
                      "rows_per_s": round(args.backlog / (done - began)), "master": "local[2]"})  # fmt: skip
            finally:
                watch.stop = True
                query.stop()


if __name__ == "__main__":
    sys.exit(main())
