"""`tidings demo` / `make demo`: the pipeline, end to end, on embedded defaults.

etcd and three brokers start as child processes (R=3 journals, fragments in a local file store);
transactional producers publish orders into two journals, with duplicate appends and rolled-back
transactions; a Structured Streaming query on local Spark sums the orders per customer, read
committed, and writes the running totals to a sink journal (exactly once) and to a result table.
The demo then checks both against what the producers committed, exactly, and stops everything.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import uvloop
from rich.console import Console
from rich.live import Live
from rich.table import Table

from tidings.client import AppendService, AsyncClient, Client
from tidings.cluster import LocalCluster
from tidings.message import AckIntent, Publisher, read_committed
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.specs import spec_from_dict
from tidings.spark.local import local_session

INPUTS = ("demo/orders-0", "demo/orders-1")
TOTALS = "demo/totals"
CUSTOMERS = ("ann", "bob", "cyd", "dee", "eve", "fay")
PRODUCERS = 3
TXNS = int(os.environ.get("TIDINGS_DEMO_TXNS", "60"))  # transactions per producer; every fifth is rolled back
PACE = float(os.environ.get("TIDINGS_DEMO_PACE", "0.25"))  # seconds between a producer's transactions


class Ledger:
    """What the producers committed (the truth the results are checked against), and what they did."""

    def __init__(self) -> None:
        self.totals: Counter[str] = Counter()
        self.orders: Counter[str] = Counter()
        self.committed = self.rolled_back = self.duplicates = 0
        self.done = threading.Event()


def run_demo(data_dir: Path, out: Console) -> None:
    shutil.rmtree(data_dir, ignore_errors=True)
    data_dir.mkdir(parents=True)
    t0 = time.monotonic()
    with LocalCluster(brokers=3, zones=3, data_dir=data_dir / "cluster") as lc:
        out.print(f"started etcd at {lc.etcd_endpoint} and 3 brokers: {', '.join(lc.endpoints)}")
        uvloop.run(_create_journals(lc))
        out.print(f"created journals {', '.join(INPUTS)} (topic=orders) and {TOTALS}, replication 3")
        out.print("starting Spark (local[2])…")
        with local_session("tidings-demo") as spark:
            spark.sparkContext.setLogLevel("ERROR")
            _pipeline(spark, lc, data_dir, out)
    out.print(f"stopped Spark, the brokers and etcd; done in {time.monotonic() - t0:.0f}s")


async def _create_journals(lc: LocalCluster) -> None:
    def spec(name: str, labels: dict[str, str]) -> pb.JournalSpec:
        fragment = {"length": "4MiB", "compression_codec": "zstd", "stores": [lc.store_url]}
        return spec_from_dict({"name": name, "replication": 3, "labels": labels, "fragment": fragment})

    ndjson = {"content-type": "application/x-ndjson"}
    specs = [spec(n, {**ndjson, "topic": "orders"}) for n in INPUTS] + [spec(TOTALS, ndjson)]
    async with AsyncClient(lc.endpoints[0]) as c:
        await c.apply([pb.ApplyRequest.Change(upsert=s) for s in specs])
        for s in specs:
            await c.append(s.name, b"")  # a zero-byte barrier: returns once the journal has its primary


def _pipeline(spark: Any, lc: LocalCluster, data_dir: Path, out: Console) -> None:
    from pyspark.sql import functions as F

    ep = lc.endpoints[0]
    orders = (
        spark.readStream.format("tidings")
        .option("broker", ep)
        .option("selector", "topic=orders")
        .option("schema", "customer STRING, amount BIGINT")
        .load()
    )
    totals = orders.groupBy("customer").agg(F.sum("amount").alias("total"), F.count("*").alias("orders"))
    to_journal = (
        totals.writeStream.format("tidings")
        .outputMode("complete")  # (Python sinks take append or complete)
        .option("broker", ep)
        .option("journal", TOTALS)
        .option("checkpointLocation", str(data_dir / "checkpoints" / "totals-journal"))
        .trigger(processingTime="500 milliseconds")
        .start()
    )
    to_table = (
        totals.writeStream.format("memory")
        .queryName("totals")
        .outputMode("complete")
        .option("checkpointLocation", str(data_dir / "checkpoints" / "totals-table"))
        .trigger(processingTime="500 milliseconds")
        .start()
    )
    out.print("streaming: orders (read committed) → sum per customer → journal demo/totals and table `totals`")
    ledger = Ledger()
    producing = threading.Thread(target=lambda: uvloop.run(_produce(ep, ledger)), name="producers", daemon=True)
    producing.start()
    with Live(_progress(spark, ledger, to_journal), console=out, refresh_per_second=4) as live:
        while not ledger.done.wait(1.0):
            live.update(_progress(spark, ledger, to_journal))
        to_journal.processAllAvailable()
        to_table.processAllAvailable()
        live.update(_progress(spark, ledger, to_journal))
    producing.join()
    to_journal.stop()
    to_table.stop()
    _check(spark, ep, ledger, out)


async def _produce(endpoint: str, ledger: Ledger) -> None:
    """Producers of order transactions; every fifth is rolled back, every committed one gets a duplicate."""
    async with AsyncClient(endpoint) as client:
        await asyncio.gather(*(_producer(client, i, ledger) for i in range(PRODUCERS)))
    ledger.done.set()


async def _producer(client: AsyncClient, index: int, ledger: Ledger) -> None:
    rng = random.Random(index)
    service = AppendService(client)
    pub = Publisher(service)
    last: dict[str, AckIntent] = {}  # per journal, the ACK of this producer's last commit there
    try:
        for txn in range(TXNS):
            size = rng.randint(1, 8)
            orders: list[dict[str, Any]] = [
                {"customer": rng.choice(CUSTOMERS), "amount": rng.randint(1, 100)} for _ in range(size)
            ]
            journal = INPUTS[(index + txn) % len(INPUTS)]
            await (await pub.publish_uncommitted(journal, *orders))
            if txn % 5 == 4 and journal in last:
                # The producer "restarts" from its checkpoint: it writes its last commit's ACK again, which
                # rolls back what it published since (a clock at or below its last ACK commits nothing new).
                pub.build_ack_intents()  # (closes the abandoned transaction on our side)
                await (await pub.write_ack_intents([last[journal]]))
                ledger.rolled_back += 1
                continue
            intents = pub.build_ack_intents()
            last.update((i.journal, i) for i in intents)
            await (await pub.write_ack_intents(intents))
            for o in orders:
                ledger.totals[o["customer"]] += o["amount"]
                ledger.orders[o["customer"]] += 1
            ledger.committed += 1
            # An append retried after a lost answer: the same message (same UUID) again.
            framing = await pub.framing(journal)
            await client.append(journal, framing.marshal(orders[0]))
            ledger.duplicates += 1
            await asyncio.sleep(PACE)  # (paced: a stream of transactions over several micro-batches)
    finally:
        await service.aclose()


def _progress(spark: Any, ledger: Ledger, query: Any) -> Table:
    t = Table(title="tidings demo", show_header=False)
    t.add_row("transactions committed / rolled back", f"{ledger.committed} / {ledger.rolled_back}")
    t.add_row("duplicate appends", str(ledger.duplicates))
    p = query.lastProgress
    t.add_row("micro-batches", str(p["batchId"] + 1) if p else "0")
    t.add_row("rows read in the last batch", str(p["numInputRows"]) if p else "0")
    try:
        t.add_row("customers in the result table", str(spark.sql("select count(*) from totals").first()[0]))
    except Exception:  # (the table appears with the first batch)
        t.add_row("customers in the result table", "0")
    return t


def _check(spark: Any, endpoint: str, ledger: Ledger, out: Console) -> None:
    table = {r.customer: (r.total, r.orders) for r in spark.sql("select * from totals").collect()}
    with Client(endpoint) as c:
        latest = {env.message["customer"]: (env.message["total"], env.message["orders"])
                  for env in read_committed(c, TOTALS, block=False)}  # fmt: skip
    expected = {c: (ledger.totals[c], ledger.orders[c]) for c in ledger.totals}
    shown = Table(title="orders per customer")
    for col in ("customer", "total", "orders", "committed by producers", "table", "journal"):
        shown.add_column(col)
    for customer in sorted(expected):
        total, n = expected[customer]
        shown.add_row(customer, str(total), str(n), "✓", _mark(table.get(customer), (total, n)),
                      _mark(latest.get(customer), (total, n)))  # fmt: skip
    out.print(shown)
    if table != expected or latest != expected:
        out.print("[red]the results differ from what was committed[/red]")
        raise SystemExit(1)
    out.print(
        f"[green]exactly once[/green]: {ledger.committed} committed transactions counted once, "
        f"{ledger.rolled_back} rolled back and {ledger.duplicates} duplicate appends not counted"
    )


def _mark(got: tuple[int, int] | None, want: tuple[int, int]) -> str:
    return "✓" if got == want else f"✗ {got}"
