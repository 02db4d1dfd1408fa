#!/usr/bin/env python3
"""Promotion of a hot standby, and playback of a recovery log.

A LocalCluster (etcd + 3 brokers); one word-count shard whose SQLite store is recorded to its
recovery log (`sqlite_store`), `hot_standbys: 1`, served by `tidings consumer` processes (each its own
--data-dir, --lease-ttl 5) while a producer publishes a word every 5 ms. Repeatedly, the primary's
process is stopped and a new process joins; the time measured runs from the signal to the first
transaction the new primary commits (a word published right after the signal, read through: Stat).

  promotion_kill9    kill -9 of the primary: its lease must expire first (the aim: TTL + 1 s)
  promotion_sigterm  SIGTERM: a hand-off; with R = 2 the allocator first brings a third replica to
                     STANDBY (its backfill is on the path), then promotes the standby (aim: < 1 s)
  playback           the shard's log played into an empty directory from its hints, as a new
                     standby does: log MB/s, and log bytes read per byte of live database

  bench/promotion.py --kills 5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import create_journal, emit, run

from tidings.client import AppendService, AsyncClient
from tidings.cluster import LocalCluster
from tidings.consumer import Application, SQLiteStore, sqlite_store
from tidings.consumer.client import ShardClient
from tidings.consumer.recovery import CONTENT_TYPE
from tidings.consumer.recoverylog.player import Player
from tidings.message import Publisher
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.specs import shard_from_dict
from tidings.protocol.status import TidingsError

COUNTS = "CREATE TABLE IF NOT EXISTS counts (word TEXT PRIMARY KEY, n INTEGER NOT NULL)"
WORDS = [f"w{i:04d}" for i in range(1000)]
SHARD, SOURCE, LOG = "bench/0", "bench/words", "bench/logs/bench/0"
LEASE_TTL = 5


class RecordedCounts(Application):
    """The consumers' application (`--app promotion:RecordedCounts`)."""

    def new_store(self, shard) -> SQLiteStore:
        return sqlite_store(shard, schema=[COUNTS])

    async def consume_message(self, shard, store, env, publisher) -> None:
        db = store.transaction()
        word = env.message["word"]
        db.execute("INSERT INTO counts VALUES (?, 1) ON CONFLICT (word) DO UPDATE SET n = n + 1", (word,))

    async def finalize_txn(self, shard, store, publisher) -> None:
        pass


class Consumers:
    """`tidings consumer` children, each with its own --data-dir, stopped by PID."""

    def __init__(self, lc: LocalCluster, work: Path) -> None:
        self.lc, self.work = lc, work
        self.procs: dict[str, subprocess.Popen] = {}
        self.endpoints: dict[str, str] = {}
        self._n = 0

    def start(self) -> None:
        suffix = f"c{self._n}"
        self._n += 1
        cmd = [sys.executable, "-m", "tidings.cli", "consumer", "--app", "promotion:RecordedCounts",
               "--etcd", self.lc.etcd_endpoint, "--broker", self.lc.brokers[0].endpoint,
               "--root", "/bench/promotion", "--data-dir", str(self.work / suffix), "--id", suffix,
               "--zone", f"zone-{'abc'[self._n % 3]}", "--listen", "127.0.0.1:0", "--metrics", "",
               "--lease-ttl", str(LEASE_TTL), "--log-level", "warning"]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
        with open(self.work / f"{suffix}.log", "ab") as log:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=env)
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        if not line.startswith("READY "):
            raise SystemExit(f"consumer {suffix} did not start: see {self.work / suffix}.log")
        self.procs[suffix], self.endpoints[suffix] = proc, line.split()[1]

    def signal(self, suffix: str, sig: int) -> subprocess.Popen:
        self.endpoints.pop(suffix)
        proc = self.procs.pop(suffix)
        proc.send_signal(sig)
        return proc

    def stop_all(self) -> None:
        for proc in self.procs.values():
            proc.kill()
            proc.wait()


async def statuses(cs: Consumers) -> dict[str, int]:
    """Each replica's status, as a live consumer lists them ({} if none answers)."""
    for endpoint in list(cs.endpoints.values()):
        try:
            async with ShardClient(endpoint, deadline=5) as sc:
                (listed,) = (await sc.list()).shards
        except (TidingsError, ValueError):
            continue
        return {m.suffix: st.code for m, st in zip(listed.route.members, listed.status, strict=True)}
    return {}


async def settled(cs: Consumers) -> str:
    """Wait for a primary and a STANDBY; the primary's suffix."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        have = await statuses(cs)
        codes = sorted(have.values())
        if pb.ReplicaStatus.PRIMARY in codes and pb.ReplicaStatus.STANDBY in codes:
            return next(s for s, c in have.items() if c == pb.ReplicaStatus.PRIMARY)
        await asyncio.sleep(0.05)
    raise SystemExit(f"no primary and standby within 120 s: {await statuses(cs)}")


async def promotion(c: AsyncClient, pub: Publisher, cs: Consumers, sig: int) -> float:
    """Stop the primary's process with `sig`; seconds until the new primary commits a word sent after."""
    victim = await settled(cs)
    t0 = time.perf_counter()
    proc = cs.signal(victim, sig)
    (span,) = await (await pub.publish_committed(SOURCE, {"word": "marker"}))
    async with ShardClient(next(iter(cs.endpoints.values()))) as sc:
        # (a SIGTERM'd primary serves on until its successor is ready: the answer must be the successor's)
        while (await sc.stat(SHARD, {SOURCE: span.end}, timeout=120)).header.process_id.suffix == victim:  # noqa: ASYNC110
            await asyncio.sleep(0.005)
    took = time.perf_counter() - t0
    await asyncio.to_thread(proc.wait, 60)
    cs.start()  # (a new process joins: the next round has a standby again)
    return took


async def produce(pub: Publisher, stop: asyncio.Event) -> None:
    rng = random.Random(1)
    while not stop.is_set():
        await pub.publish_committed(SOURCE, {"word": rng.choice(WORDS)})
        await asyncio.sleep(0.005)


async def playback(c: AsyncClient, endpoint: str, work: Path) -> None:
    async with ShardClient(endpoint) as sc:
        hints = (await sc.get_hints(SHARD)).primary_hints
    dir = work / "played"
    player = Player(c, hints.hints if hints.HasField("hints") else pb.FSMHints(log=LOG), dir)
    player.finish_at_write_head()
    t0 = time.perf_counter()
    await player.play()
    took = time.perf_counter() - t0
    live = sum(p.stat().st_size for p in dir.iterdir() if p.is_file())
    read = player.statistics().bytes_read
    emit({"test": "playback", "log_bytes_read": read, "live_bytes": live, "seconds": round(took, 3),
          "mb_per_s": round(read / took / 1e6, 1), "read_per_live_byte": round(read / max(1, live), 2),
          "log_head": await c.write_head(LOG), "seeks": player.statistics().seeks})  # fmt: skip


def summary(name: str, values: list[float]) -> None:
    emit({"test": name, "median_s": round(statistics.median(values), 3), "max_s": round(max(values), 3),
          "min_s": round(min(values), 3), "samples": len(values), "lease_ttl_s": LEASE_TTL})  # fmt: skip


async def bench(lc: LocalCluster, args: argparse.Namespace, work: Path) -> None:
    cs = Consumers(lc, work)
    async with AsyncClient(lc.brokers[0].endpoint) as c:
        await create_journal(c, lc, SOURCE, 3)
        await create_journal(c, lc, LOG, 3, labels={"content-type": CONTENT_TYPE}, fragment_length="16MiB")
        pub = Publisher(AppendService(c))
        stop = asyncio.Event()
        producing = asyncio.ensure_future(produce(pub, stop))
        try:
            for _ in range(3):
                cs.start()
            spec = shard_from_dict({"id": SHARD, "sources": [SOURCE], "recovery_log_prefix": "bench/logs",
                                    "hot_standbys": 1, "max_txn_duration": "100ms"})  # fmt: skip
            async with ShardClient(next(iter(cs.endpoints.values()))) as sc:
                await sc.apply([pb.ShardApplyRequest.Change(upsert=spec)])
            kill9 = [await promotion(c, pub, cs, signal.SIGKILL) for _ in range(args.kills)]
            summary("promotion_kill9", kill9)
            sigterm = [await promotion(c, pub, cs, signal.SIGTERM) for _ in range(args.kills)]
            summary("promotion_sigterm", sigterm)
            await playback(c, next(iter(cs.endpoints.values())), work)
        finally:
            stop.set()
            await producing
            await pub.service.aclose()
            cs.stop_all()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=5, help="of each kind (kill -9, SIGTERM)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tidings-bench-promotion-") as tmp:
        work = Path(tmp)
        lc = LocalCluster(brokers=3, zones=3, data_dir=work / "cluster")
        try:
            lc.start()
            run(bench(lc, args, work))
        finally:
            lc.stop()


if __name__ == "__main__":
    main()
