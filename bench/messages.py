#!/usr/bin/env python3
"""Message benchmark against a local cluster (etcd + 3 broker processes on loopback), R=3.

Prints one JSON line per measurement (fields as in bench/append.py and the peers' harness:
system, replicas, test, payload_bytes, msgs_per_s, mb_per_s) and then a table that also shows
the NATS JetStream exactly-once publish figures found in bench/results/nats-*.jsonl (measured
on this machine with ../shared/peers/nats; re-run that harness to refresh them).

  publish_committed      200-byte JSON messages, OUTSIDE_TXN, through Publisher + AppendService
  publish_transactional  the same, CONTINUE_TXN with an ACK every 100 messages
  read_committed         every message of each journal, through read_committed (Sequencer included),
                         one message at a time; read_committed_batches: a list per chunk read

  bench/messages.py --messages 300000
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import time

from _ab import main_if_requested
from _common import create_journal, emit, run

from tidings.client import AppendService, AsyncClient
from tidings.cluster import LocalCluster
from tidings.message import Publisher, read_committed

MB = 1_000_000
PAYLOAD = 200  # bytes of each JSON line, uuid included


def messages(n: int, start: int = 0) -> list[dict]:
    # {"id":…,"user":…,"text":…,"uuid":"…36…"} comes to PAYLOAD bytes with its newline.
    filler = "x" * (PAYLOAD - 96)
    return [{"id": start + i, "user": f"u{(start + i) % 1000:04d}", "text": filler} for i in range(n)]


async def publish(c: AsyncClient, journal: str, total: int, txn_size: int | None, batch: int) -> dict:
    svc = AppendService(c)
    pub = Publisher(svc)
    pending = []
    t0 = time.perf_counter()
    sent = 0
    while sent < total:
        n = min(batch if txn_size is None else txn_size, total - sent)
        msgs = messages(n, sent)
        if txn_size is None:
            pending.append(await pub.publish_committed(journal, *msgs))
        else:
            pending.append(await pub.publish_uncommitted(journal, *msgs))
            pending.append(await pub.write_ack_intents(pub.build_ack_intents()))
        sent += n
        if len(pending) > 64:  # keep a bounded number of futures in hand
            await pending.pop(0)
    for fut in pending:
        await fut
    elapsed = time.perf_counter() - t0
    await svc.aclose()
    stats = svc.statistics()
    return emit(
        {
            "test": "publish_committed" if txn_size is None else "publish_transactional",
            "payload_bytes": PAYLOAD,
            "msgs_per_s": round(total / elapsed),
            "mb_per_s": round(stats.bytes / elapsed / MB, 1),
            "count": total,
            "seconds": round(elapsed, 2),
            "append_rpcs": stats.batches,
            **({"txn_size": txn_size} if txn_size else {}),
        },
        replicas=3,
    )


async def read_all_committed(c: AsyncClient, journal: str, expect: int, batches: bool) -> dict:
    t0 = time.perf_counter()
    n = 0
    reader = read_committed(c, journal, block=False)
    if batches:
        async for batch in reader.batches():
            n += len(batch)
    else:
        async for _env in reader:
            n += 1
    elapsed = time.perf_counter() - t0
    if n != expect:
        raise RuntimeError(f"read {n} committed messages of {journal}, expected {expect}")
    return emit(
        {
            "test": "read_committed_batches" if batches else "read_committed",
            "payload_bytes": PAYLOAD,
            "msgs_per_s": round(n / elapsed),
            "mb_per_s": round(n * PAYLOAD / elapsed / MB, 1),
            "count": n,
            "seconds": round(elapsed, 2),
            "journal": journal,
        },
        replicas=3,
    )


def nats_rows() -> list[dict]:
    here = os.path.dirname(os.path.abspath(__file__))
    rows = []
    for path in sorted(glob.glob(os.path.join(here, "results", "nats-*.jsonl"))):
        with open(path) as fh:
            rows.extend(json.loads(line) for line in fh if line.strip())
    return [r for r in rows if r["test"].startswith("publish_dedup") or r["test"] == "publish_pipelined"]


def table(recs: list[dict]) -> None:
    print(f"\n{'system':<15} {'R':>2} {'test':<30} {'journal':<16} {'payload':>8} {'msg/s':>9} {'MB/s':>7}")
    for x in recs + [r for r in nats_rows() if r["payload_bytes"] <= 1024]:
        print(
            f"{x['system']:<15} {x['replicas']:>2} {x['test']:<30} {x.get('journal', ''):<16} {x['payload_bytes']:>8} "
            f"{round(x['msgs_per_s']):>9} {x.get('mb_per_s', ''):>7}"
        )


async def main_async(args: argparse.Namespace) -> None:
    recs = []
    with tempfile.TemporaryDirectory(prefix="tidings-bench-") as tmp:
        lc = LocalCluster(brokers=3, zones=3, data_dir=tmp)
        lc.extra = ["--log-level", "warning"]
        with lc:
            async with AsyncClient(lc.endpoints[0]) as c:
                for name in ("bench/committed", "bench/txn"):
                    await create_journal(c, lc, name, 3, {"content-type": "application/x-ndjson"})
                route = next(j.route for j in (await c.list()).journals if j.spec.name == "bench/committed")
            async with AsyncClient(route.endpoints[route.primary]) as c:
                recs.append(await publish(c, "bench/committed", args.messages, None, args.batch))
                recs.append(await publish(c, "bench/txn", args.messages, 100, args.batch))
                for journal in ("bench/committed", "bench/txn"):
                    for batches in (False, True):
                        recs.append(await read_all_committed(c, journal, args.messages, batches))
    table(recs)


def main() -> None:
    main_if_requested("messages.py")  # (--ab REF: this tree against REF, interleaved; bench/_ab.py)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--messages", type=int, default=300_000, help="messages per measurement")
    p.add_argument("--batch", type=int, default=1000, help="messages per publish_committed call")
    run(main_async(p.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
