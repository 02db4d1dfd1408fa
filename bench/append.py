#!/usr/bin/env python3
"""Append benchmark against a local cluster (etcd + 3 broker processes on loopback).

Prints one JSON line per measurement (same fields as ../shared/peers/nats/bench_nats.py:
system, replicas, test, payload_bytes, median_us, p99_us, msgs_per_s, mb_per_s) and a table.
MB = 10^6 payload bytes.

  bench/append.py                       # everything, R=1 and R=3
  bench/append.py --replicas 3 --seconds 3 --big-mib 256
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import threading
import time

from _common import create_journal, emit, primary_endpoint, run

from tidings.client import AsyncClient
from tidings.cluster import LocalCluster

KiB, MiB, MB = 1024, 1024 * 1024, 1_000_000


async def sequential(lc, r: int, size: int, count: int) -> dict:
    name = f"bench/seq-r{r}-{size}"
    async with AsyncClient(lc.endpoints[0]) as c0:
        await create_journal(c0, lc, name, r)
        ep = await primary_endpoint(c0, name)
    body = os.urandom(size)
    lat = []
    async with AsyncClient(ep) as c:
        for _ in range(200):
            await c.append(name, body)
        for _ in range(count):
            t = time.perf_counter()
            await c.append(name, body)
            lat.append(time.perf_counter() - t)
    lat.sort()
    return emit(
        {
            "replicas": r,
            "test": "append_sync",
            "payload_bytes": size,
            "median_us": round(statistics.median(lat) * 1e6),
            "p99_us": round(lat[int(len(lat) * 0.99)] * 1e6),
            "msgs_per_s": round(len(lat) / sum(lat)),
            "mb_per_s": round(size * len(lat) / sum(lat) / MB, 1),
            "count": count,
        }
    )


async def pipelined(lc, r: int, size: int, seconds: float, window: int) -> dict:
    name = f"bench/pipe-r{r}-{size}"
    async with AsyncClient(lc.endpoints[0]) as c0:
        await create_journal(c0, lc, name, r)
        ep = await primary_endpoint(c0, name)
    body = os.urandom(size)
    done = 0
    lat: list[float] = []
    async with AsyncClient(ep) as c:
        deadline = time.perf_counter() + seconds
        t0 = time.perf_counter()

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                t = time.perf_counter()
                await c.append(name, body)
                lat.append(time.perf_counter() - t)
                done += 1

        await asyncio.gather(*(worker() for _ in range(window)))
        elapsed = time.perf_counter() - t0
    lat.sort()
    return emit(
        {
            "replicas": r,
            "test": "append_pipelined",
            "payload_bytes": size,
            "median_us": round(statistics.median(lat) * 1e6),
            "p99_us": round(lat[int(len(lat) * 0.99)] * 1e6),
            "msgs_per_s": round(done / elapsed),
            "mb_per_s": round(done * size / elapsed / MB, 1),
            "window": window,
        }
    )


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


async def big_append(lc, r: int, mib: int) -> dict:
    """One append of `mib` MiB streamed in 256 KiB chunks; sample every broker's RSS meanwhile."""
    name = f"bench/big-r{r}"
    async with AsyncClient(lc.endpoints[0]) as c0:
        await create_journal(c0, lc, name, r)
        ep = await primary_endpoint(c0, name)
    pids = [b.pid for b in lc.brokers if b.alive()]
    before = {p: rss_kib(p) for p in pids}
    peak = dict(before)
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.05):
            for p in pids:
                peak[p] = max(peak[p], rss_kib(p))

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    chunk = os.urandom(256 * KiB)

    async def gen():
        for _ in range(mib * 4):
            yield chunk

    t0 = time.perf_counter()
    async with AsyncClient(ep) as c:
        res = await c.append(name, gen())
    elapsed = time.perf_counter() - t0
    stop.set()
    th.join()
    growth = max(peak[p] - before[p] for p in pids)
    return emit(
        {
            "replicas": r,
            "test": "append_single_large",
            "payload_bytes": res.end - res.begin,
            "mb_per_s": round((res.end - res.begin) / elapsed / MB, 1),
            "seconds": round(elapsed, 2),
            "broker_rss_growth_mib": round(growth / 1024, 1),
            "broker_rss_peak_mib": round(max(peak.values()) / 1024, 1),
        }
    )


def table(recs: list[dict]) -> None:
    print(f"\n{'R':>2} {'test':<22} {'payload':>9} {'median_us':>10} {'p99_us':>8} {'msg/s':>8} {'MB/s':>7}")
    for x in recs:
        print(
            f"{x['replicas']:>2} {x['test']:<22} {x['payload_bytes']:>9} {x.get('median_us', ''):>10} "
            f"{x.get('p99_us', ''):>8} {x.get('msgs_per_s', ''):>8} {x.get('mb_per_s', ''):>7}"
        )


async def main_async(args) -> None:
    recs = []
    with tempfile.TemporaryDirectory(prefix="tidings-bench-") as tmp:
        lc = LocalCluster(brokers=3, zones=3, data_dir=tmp)
        lc.extra = ["--log-level", "warning"]
        with lc:
            for r in args.replicas:
                recs.append(await sequential(lc, r, KiB, args.count))
                for size in (KiB, 64 * KiB, MiB):
                    window = 64 if size <= 64 * KiB else 16
                    recs.append(await pipelined(lc, r, size, args.seconds, window))
                recs.append(await big_append(lc, r, args.big_mib))
    table(recs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 3])
    p.add_argument("--count", type=int, default=2000, help="sequential appends timed")
    p.add_argument("--seconds", type=float, default=5.0, help="per pipelined measurement")
    p.add_argument("--big-mib", type=int, default=1024, help="size of the single large append")
    run(main_async(p.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
