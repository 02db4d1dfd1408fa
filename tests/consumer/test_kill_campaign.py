"""Consumer processes killed at random points of their transactions, and stopped with SIGTERM and
joined by new ones, while producers publish (DESIGN.md invariants 8 and 10).

- examples/wordcount.py's two stages (a shuffle by word, then counts in SQLite stores) must end
  with each word counted exactly as published, in the stores and downstream (read committed: each
  word's running counts 1..n once).
- tests.support.apps.Relay shards publish through every path docs/shards.md offers (the hook's
  publisher, uncommitted and committed; `shard.publisher`, from `consume_message` and `begin_txn`),
  outputs of hundreds of KiB so that appends are in flight when a process dies; processes also die
  by plan right after a store commit resolves (before its ACKs), and a downstream journal is deleted
  and created again mid-run (its shard fails naming it, and the operator's `unassign --failed`
  brings it back). Every input must end counted once in its shard's store and present downstream:
  once for transactional outputs, at least once for committed ones.

Real etcd and brokers (in this process), consumers as `tidings consumer` child processes, stopped
by PID whatever happens. The campaigns' size: TIDINGS_CONSUMER_KILLS (default 3 in `make test`)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
from collections import Counter
from pathlib import Path

import pytest
from examples.wordcount import counts_published, journal_specs, publish_lines, shard_specs

from tests.support.apps import seen
from tests.support.consumer_procs import ConsumerProcs
from tests.support.waiting import wait_until
from tidings.client import AppendService
from tidings.consumer import SQLiteStore
from tidings.consumer.client import ShardClient
from tidings.consumer.recoverylog.player import Player
from tidings.consumer.store_recorded import DATABASE
from tidings.message import Publisher, read_committed
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.specs import shard_from_dict
from tidings.protocol.status import TransportError

KILLS = int(os.environ.get("TIDINGS_CONSUMER_KILLS", "3"))
SEED = int(os.environ.get("TIDINGS_CAMPAIGN_SEED", "20261124"))
PREFIX, PARTS = "wc", 2
BATCHES_PER_ROUND = 3  # of 100 lines


def store_counts(data_dir: Path) -> Counter:
    total: Counter = Counter()
    for path in sorted((data_dir / "shards").glob("*count*.db")):
        store = SQLiteStore(path)
        try:
            total.update(dict(store.db.execute("SELECT word, n FROM counts").fetchall()))
        finally:
            store.destroy()
    return total


@pytest.mark.parametrize("stores", ["files", "recorded"])
async def test_word_counts_are_exact_through_kill_9_sigterm_and_joins(cluster, etcd_root, tmp_path, stores) -> None:
    """With `recorded` stores every shard has a recovery log and a hot standby: a killed primary's
    successor plays its store from the log (no shared directory is read)."""
    recorded = stores == "recorded"
    async with cluster.client() as c:
        await c.apply([pb.ApplyRequest.Change(upsert=s) for s in journal_specs(PREFIX, PARTS, 3, recorded)])
    for spec in journal_specs(PREFIX, PARTS, 3, recorded):
        await cluster.wait_consistent(spec.name, 3)
    # (with recorded stores every shard has a standby, so a SIGTERM'd consumer finds no other one free to take
    # its shards, waits --exit-timeout for one to join, then stops anyway: that path, in 4 s rather than 20)
    procs = ConsumerProcs(cluster, etcd_root + "-consumer", tmp_path, "examples.wordcount:WordCount", exit_timeout=4)
    rng = random.Random(SEED)
    try:
        first = await procs.start("c0", "zone-a")
        await procs.start("c1", "zone-b")
        async with ShardClient(first) as sc:
            await sc.apply([pb.ShardApplyRequest.Change(upsert=s) for s in shard_specs(PREFIX, PARTS, recorded)])
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
        if recorded:
            async with cluster.client() as c:
                assert await played_counts(c, tmp_path / "played") == expected
        else:
            await wait_until(lambda: store_counts(tmp_path) == expected, 60, interval=0.2)
    finally:
        procs.stop_all()


async def played_counts(c, dir: Path) -> Counter:
    """The count shards' stores as their recovery logs hold them (each played into a fresh directory)."""
    total: Counter = Counter()
    for i in range(PARTS):
        player = Player(c, pb.FSMHints(log=f"{PREFIX}/logs/{PREFIX}/count/{i}"), dir / str(i))
        player.finish_at_write_head()
        await player.play()
        store = SQLiteStore(dir / str(i) / DATABASE)
        try:
            total.update(dict(store.db.execute("SELECT word, n FROM counts").fetchall()))
        finally:
            store.destroy()
    return total


async def _primaries(procs: ConsumerProcs) -> set[str] | None:
    """The live processes holding the shards' primaries, once every shard has one serving (else None)."""
    if not procs.live():
        raise AssertionError("every consumer process exited (see their logs)")
    listed = await procs.shards()
    if listed is None:
        return None
    holders = set()
    for s in listed:
        if s.route.primary < 0 or s.status[s.route.primary].code != pb.ReplicaStatus.PRIMARY:
            return None
        holders.add(s.route.members[s.route.primary].suffix)
    return holders if listed and holders <= set(procs.procs) else None


async def _head_at_least(c, journal: str, offset: int) -> bool:
    return await c.write_head(journal) >= offset


# -- Relay shards: every publishing path, large outputs, planned kills, a deleted downstream journal --

MODES = ["uncommitted", "committed", "shard-uncommitted", "shard-committed", "begin"]
AT_LEAST_ONCE = {"committed", "shard-committed"}
SIDE = "rl/side"  # written by the "uncommitted" shard too; deleted and created again mid-run
PAD = 128 << 10  # bytes of padding per output: appends stay in flight while transactions commit
INPUTS_PER_ROUND = 8  # per shard


def relay_shards() -> list[pb.ShardSpec]:
    return [
        shard_from_dict(
            {
                "id": f"rl/{mode}",
                "sources": [f"rl/in/{mode}"],
                "max_txn_duration": "500ms",
                "labels": {
                    "mode": mode,
                    "out": f"rl/out/{mode}",
                    "pad": str(PAD),
                    **({"side": SIDE} if mode == "uncommitted" else {}),
                },
            }
        )
        for mode in MODES
    ]


async def _ids_in(c, journal: str) -> Counter:
    got: Counter = Counter()
    async for env in read_committed(c, journal, block=False):
        if not env.message["id"].startswith("begin:"):
            got[env.message["id"]] += 1
    return got


async def test_relay_outputs_are_exact_through_kills_at_commits_large_appends_and_a_deleted_output(
    cluster, etcd_root, tmp_path
) -> None:
    journals = [*(f"rl/in/{m}" for m in MODES), *(f"rl/out/{m}" for m in MODES), SIDE]
    for name in journals:
        await cluster.create_journal(name, 3)
    procs = ConsumerProcs(cluster, etcd_root + "-consumer", tmp_path, "tests.support.apps:Relay")
    rng = random.Random(SEED + 1)
    published: dict[str, list[str]] = {m: [] for m in MODES}
    serial = iter(range(1_000_000))
    zones = ["zone-a", "zone-b", "zone-c"]

    async def join(planned_kill: bool) -> None:
        """A new consumer; with a planned kill it dies right after its k-th store commit resolves."""
        env = {"TIDINGS_TEST_KILL_AFTER_COMMIT": str(rng.randint(1, 6))} if planned_kill else {}
        await procs.start(f"c{next(serial)}", rng.choice(zones), env=env)

    async def publish_round(c, pubs: dict[str, Publisher]) -> None:
        for mode in MODES:
            ids = [f"{mode}-{next(serial)}" for _ in range(INPUTS_PER_ROUND)]
            published[mode] += ids
            await (await pubs[mode].publish_committed(f"rl/in/{mode}", *({"id": i} for i in ids)))

    events: Counter = Counter()  # what the campaign did (printed at the end: pytest -s shows it)

    async def reap() -> None:
        """Forget processes that died by plan; keep two alive."""
        dead = [s for s, p in procs.procs.items() if p.poll() is not None]
        for suffix in dead:
            assert await procs.wait_exit(suffix, 10) == -signal.SIGKILL, procs.log(suffix)[-3000:]
            events["died right after a store commit"] += 1
        while len(procs.procs) < 2:
            await join(planned_kill=rng.random() < 0.6)

    try:
        await join(planned_kill=False)
        await join(planned_kill=True)
        async with ShardClient(procs.live()[0]) as sc:
            await sc.apply([pb.ShardApplyRequest.Change(upsert=s) for s in relay_shards()])
        async with cluster.client() as c:
            pubs = {m: Publisher(AppendService(c)) for m in MODES}
            deleted_at = rng.randrange(KILLS)
            failures: list[str] = []
            for round_ in range(KILLS):
                await reap()
                failures += await _unassign_failed(procs)  # (the operator, once the deleted output is back)
                # Some progress downstream (of what this round publishes), or a planned kill...
                target = await _out_bytes(c) + rng.randrange(1, 4) * PAD
                await publish_round(c, pubs)
                await wait_until(lambda c=c, t=target: _progress_or_death(c, procs, t), 120, interval=0.05)
                # ... then a kill -9 mid-stream, or a SIGTERM (a hand-off), of a live process.
                live = [s for s, p in procs.procs.items() if p.poll() is None]
                if live:
                    sig = signal.SIGTERM if round_ % 3 == 2 else signal.SIGKILL
                    await procs.kill(rng.choice(live), sig)
                    events[signal.Signals(sig).name] += 1
                if round_ == deleted_at:  # an operator deletes the side output, and creates it again
                    await _delete(c, SIDE)
                    await publish_round(c, pubs)  # (the uncommitted shard fails on its side output...)
                    await wait_until(lambda: _failed(procs, "rl/uncommitted"), 60, interval=0.1)
                    # (over a fresh store: the old one holds the deleted journal's fragments, and a journal
                    # created again over them refuses appends until `journals reset-head`)
                    fresh = f"file://{tmp_path / f'side-store-{round_}'}/"
                    await cluster.create_journal(SIDE, 3, fragment={"stores": [fresh]})
            # The end: no more kills; the operator brings back what failed (the deleted output's shard).
            for suffix in list(procs.procs):
                if procs.procs[suffix].poll() is not None:
                    await procs.wait_exit(suffix, 10)
            await join(planned_kill=False)
            await join(planned_kill=False)
            for pub in pubs.values():
                await pub.service.aclose()

            complete: set[str] = set()

            async def all_out() -> bool:
                failures.extend(await _unassign_failed(procs))
                for mode in sorted(set(MODES) - complete):
                    if set(await _ids_in(c, f"rl/out/{mode}")) != set(published[mode]):
                        return False
                    complete.add(mode)
                return True

            try:
                await wait_until(all_out, 240, interval=0.5)
            except AssertionError:
                missing = {m: set(published[m]) - set(await _ids_in(c, f"rl/out/{m}")) for m in MODES}
                raise AssertionError(f"outputs missing after 240 s: {missing}") from None
            for mode in MODES:
                got = await _ids_in(c, f"rl/out/{mode}")
                if mode in AT_LEAST_ONCE:
                    assert set(got) == set(published[mode]), mode
                else:
                    assert got == Counter(published[mode]), (mode, got - Counter(published[mode]))
                store = tmp_path / "shards" / f"rl%2F{mode}.db"
                assert seen(store) == dict.fromkeys(published[mode], 1), mode
            side = await _ids_in(c, SIDE)
            assert all(n == 1 for n in side.values()), side  # (read committed: never twice)
            # Only the deleted output failed a shard, and its reason says so.
            assert all(f"output journal {SIDE!r}" in f for f in failures), failures
            events["FAILED (the deleted output)"] = len(failures)
            print(f"relay campaign: {dict(events)}; inputs {sum(map(len, published.values()))}")
    finally:
        procs.stop_all()


async def _out_bytes(c) -> int:
    return sum([await c.write_head(f"rl/out/{mode}") for mode in MODES])


async def _progress_or_death(c, procs: ConsumerProcs, target: int) -> bool:
    if any(p.poll() is not None for p in procs.procs.values()):
        return True
    return await _out_bytes(c) >= target


async def _delete(c, journal: str) -> None:
    revision = {j.spec.name: j.mod_revision for j in (await c.list()).journals}[journal]
    await c.apply([pb.ApplyRequest.Change(delete=journal, expect_mod_revision=revision)])


async def _failed(procs: ConsumerProcs, shard_id: str) -> bool:
    """Whether the shard is FAILED (replacing consumers that died by plan meanwhile)."""
    for suffix, proc in list(procs.procs.items()):
        if proc.poll() is not None:
            await procs.wait_exit(suffix, 10)
    if not procs.live():
        await procs.start(f"c-after-{len(procs.procs)}", "zone-a")
    listed = await procs.shards() or []
    return any(s.spec.id == shard_id and pb.ReplicaStatus.FAILED in [st.code for st in s.status] for s in listed)


async def _unassign_failed(procs: ConsumerProcs) -> list[str]:
    """What the operator does for a FAILED shard once mended: `shards unassign --failed`. Returns the
    reasons the failed shards gave."""
    for endpoint in procs.live():
        try:
            async with ShardClient(endpoint) as sc:
                listed = (await sc.list()).shards
                reasons = [
                    e for s in listed for st in s.status if st.code == pb.ReplicaStatus.FAILED for e in st.errors
                ]
                if reasons:
                    await sc.unassign([s.id for s in relay_shards()], only_failed=True)
                return reasons
        except TransportError:
            continue
    return []
