"""Consumer processes killed at random points of their transactions (issue 10's kill -9 test), and
stopped with SIGTERM and joined by new ones, while producers publish: examples/wordcount.py's two
stages (a shuffle by word, then counts in SQLite stores) must end with each word counted exactly as
published, in the stores and downstream (read committed: each word's running counts 1..n once).

Real etcd and brokers (in this process), consumers as `tidings consumer` child processes, stopped
by PID whatever happens. The campaign's size: TIDINGS_CONSUMER_KILLS (default 3 in `make test`)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

from examples.wordcount import counts_published, journal_specs, publish_lines, shard_specs

from tests.support.waiting import wait_until
from tidings.consumer import SQLiteStore
from tidings.consumer.client import ShardClient
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import TransportError

KILLS = int(os.environ.get("TIDINGS_CONSUMER_KILLS", "3"))
PREFIX, PARTS = "wc", 2
BATCHES_PER_ROUND = 3  # of 100 lines
REPO = Path(__file__).resolve().parent.parent


class ConsumerProcs:
    """`tidings consumer` children serving examples.wordcount:WordCount, by id."""

    def __init__(self, cluster, root: str, data_dir: Path) -> None:
        self.cluster, self.root, self.data_dir = cluster, root, data_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.endpoints: dict[str, str] = {}

    async def start(self, suffix: str, zone: str) -> str:
        cmd = [sys.executable, "-m", "tidings.cli", "consumer", "--app", "examples.wordcount:WordCount",
               "--etcd", self.cluster.etcd_endpoint, "--broker", self.cluster.brokers[0].endpoint,
               "--root", self.root, "--data-dir", str(self.data_dir / "shards"), "--id", suffix, "--zone", zone,
               "--listen", "127.0.0.1:0", "--metrics", "", "--lease-ttl", "2", "--exit-timeout", "20"]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
        proc = self.procs[suffix] = _spawn(cmd, env, self.data_dir / f"{suffix}.log")
        assert proc.stdout is not None
        line = (await asyncio.to_thread(proc.stdout.readline)).decode()  # (the brokers run on this loop)
        assert line.startswith("READY "), (line, (self.data_dir / f"{suffix}.log").read_text()[-2000:])
        self.endpoints[suffix] = line.split()[1]
        return self.endpoints[suffix]

    async def kill(self, suffix: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.pop(suffix)
        self.endpoints.pop(suffix)
        proc.send_signal(sig)
        await asyncio.to_thread(proc.wait, 60)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            proc.kill()
            proc.wait(30)
        self.procs.clear()


def _spawn(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """A child writing its stderr to `log` (a quick, local call: fine on the event loop)."""
    with log.open("ab") as f:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=f, env=env)


def store_counts(data_dir: Path) -> Counter:
    total: Counter = Counter()
    for path in sorted((data_dir / "shards").glob("*count*.db")):
        store = SQLiteStore(path)
        try:
            total.update(dict(store.db.execute("SELECT word, n FROM counts").fetchall()))
        finally:
            store.destroy()
    return total


async def test_word_counts_are_exact_through_kill_9_sigterm_and_joins(cluster, etcd_root, tmp_path) -> None:
    async with cluster.client() as c:
        await c.apply([pb.ApplyRequest.Change(upsert=s) for s in journal_specs(PREFIX, PARTS, 3)])
    for spec in journal_specs(PREFIX, PARTS, 3):
        await cluster.wait_consistent(spec.name, 3)
    procs = ConsumerProcs(cluster, etcd_root + "-consumer", tmp_path)
    rng = random.Random(int(os.environ.get("TIDINGS_CAMPAIGN_SEED", "20261124")))
    try:
        first = await procs.start("c0", "zone-a")
        await procs.start("c1", "zone-b")
        async with ShardClient(first) as sc:
            await sc.apply([pb.ShardApplyRequest.Change(upsert=s) for s in shard_specs(PREFIX, PARTS)])
        expected: Counter = Counter()
        done_producing = asyncio.Event()
        credit = asyncio.Semaphore(BATCHES_PER_ROUND)  # input keeps coming, bounded: so many batches a round

        async def produce() -> None:
            """Lines keep coming until the campaign ends."""
            i = 0
            while not done_producing.is_set():
                await credit.acquire()
                expected.update(await publish_lines(cluster.brokers[0].endpoint, PREFIX, PARTS, 100, seed=i))
                i += 1

        producing = asyncio.ensure_future(produce())
        next_id = 2
        for round_ in range(KILLS):
            # Every shard served by a live primary, which then makes a random amount of progress downstream...
            holders = await wait_until(lambda: _primaries(procs), 60, interval=0.1)
            async with cluster.client() as c:
                target = await c.write_head(f"{PREFIX}/counts") + rng.randrange(500, 30_000)

                def progressed(c=c, target=target):  # (more input as long as the target is not reached)
                    if credit.locked():
                        credit.release()
                    return _head_at_least(c, f"{PREFIX}/counts", target)

                await wait_until(progressed, 120, interval=0.05)
            # ... then one of them dies mid-stream (kill -9), or every third round stops (SIGTERM: a hand-off).
            victim = rng.choice(sorted(holders))
            await procs.kill(victim, signal.SIGTERM if round_ % 3 == 2 else signal.SIGKILL)
            await procs.start(f"c{next_id}", rng.choice(["zone-a", "zone-b", "zone-c"]))  # a new process joins
            next_id += 1
        done_producing.set()
        credit.release()
        await producing
        published = sum(expected.values())

        async def all_counted() -> bool:
            counted, problems = await counts_published(cluster.brokers[0].endpoint, PREFIX)
            assert not problems, problems  # never a count twice or skipped, read committed
            return sum(counted.values()) >= published

        try:
            await wait_until(all_counted, 180, interval=0.2)
        except AssertionError:
            counted, _ = await counts_published(cluster.brokers[0].endpoint, PREFIX)
            short = {w: n - counted.get(w, 0) for w, n in expected.items() if counted.get(w, 0) != n}
            raise AssertionError(f"after 180 s, downstream counts differ (word: missing) {short}") from None
        counted, _ = await counts_published(cluster.brokers[0].endpoint, PREFIX)
        assert counted == dict(expected)
        await wait_until(lambda: store_counts(tmp_path) == expected, 60, interval=0.2)
    finally:
        procs.stop_all()


async def _primaries(procs: ConsumerProcs) -> set[str] | None:
    """The live processes holding the shards' primaries, once every shard has one serving (else None)."""
    live = [e for suffix, e in procs.endpoints.items() if procs.procs[suffix].poll() is None]
    if not live:
        raise AssertionError("every consumer process exited (see their logs)")
    try:
        async with ShardClient(live[0]) as sc:
            listed = (await sc.list()).shards
    except TransportError:  # (it exited just now)
        return None
    holders = set()
    for s in listed:
        if s.route.primary < 0 or s.status[s.route.primary].code != pb.ReplicaStatus.PRIMARY:
            return None
        holders.add(s.route.members[s.route.primary].suffix)
    return holders if listed and holders <= set(procs.procs) else None


async def _head_at_least(c, journal: str, offset: int) -> bool:
    return await c.write_head(journal) >= offset
