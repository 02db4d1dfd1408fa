"""Word count with a shuffle, exactly once: a consumer application in two stages.

- `split/N` shards read lines from `{prefix}/lines/part-N` and publish each word to the words
  partition its hash picks, `{prefix}/words/part-M` (the shuffle), uncommitted in their transaction;
- `count/M` shards read their words partition, keep the counts in their SQLite store, and publish
  each word's running count ``{"word": w, "n": n}`` to `{prefix}/counts`.

A shard's stage and partitions come from its labels (`stage`, `prefix`, `parts`). Whatever crashes,
each line's words are counted once: the stores hold the exact counts and `{prefix}/counts`, read
committed, holds each word's counts 1, 2, ..., n once each.

Run it against `tidings cluster up` (its `etcd` line gives --etcd)::

    .venv/bin/python -m examples.wordcount --etcd 127.0.0.1:PORT --lines 2000

It creates the journals and shards, starts two `tidings consumer` processes serving this module's
`WordCount`, publishes random lines, waits until every word is counted, checks the counts against
what it published (exactly), prints them and stops the consumers.

With `--recorded`, every shard's store is recorded to its recovery log (`{prefix}/logs/{shard id}`)
and has a hot standby; each consumer process has a --data-dir of its own (no shared disk), and once
half the lines are in, the first consumer is killed (kill -9, as a lost host): its standbys take its
shards over from their recovery logs, and the counts stay exact.
"""

from __future__ import annotations

import asyncio
import random
import time
import zlib
from collections import Counter
from typing import Any

from examples._consumers import arguments, consumers, create, failures, parse, wait_for

from tidings.client import AppendService, AsyncClient
from tidings.consumer import Application, SQLiteStore, sqlite_store
from tidings.message import Publisher, read_committed
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.specs import shard_from_dict, spec_from_dict

WORDS = "the quick brown fox jumps over the lazy dog while seven wizards quietly hex jumbled boxes".split()


def _label(shard: Any, name: str) -> str:
    return next((lb.value for lb in shard.spec.labels.labels if lb.name == name), "")


NEEDS = {  # the labels a WordCount shard's spec gives, what each says, and how each is checked
    "stage": ("split or count", lambda v: v in ("split", "count")),
    "prefix": ("the journals' prefix, e.g. wc", lambda v: bool(v) and not v.startswith("/") and not v.endswith("/")),
    "parts": ("the number of words partitions, e.g. 2", lambda v: v.isdigit() and int(v) > 0),
}


def check_labels(shard: Any) -> None:
    """Fail the shard at its start, naming the label, rather than on a journal named from a missing one."""
    for name, (what, ok) in NEEDS.items():
        if not ok(_label(shard, name)):
            given = _label(shard, name)
            raise ValueError(
                f"WordCount needs the label {name!r} ({what}); the spec of shard {shard.spec.id} "
                f"{'gives ' + repr(given) if given else 'lacks it'} (examples/shards.yaml shows one)"
            )


class WordCount(Application):
    """The application (`tidings consumer --app examples.wordcount:WordCount`)."""

    def new_store(self, shard: Any) -> SQLiteStore:
        check_labels(shard)
        counts = "CREATE TABLE IF NOT EXISTS counts (word TEXT PRIMARY KEY, n INTEGER NOT NULL)"
        # (recorded to the shard's recovery log when its spec has one: then no shared --data-dir)
        return sqlite_store(shard, schema=[counts] if _label(shard, "stage") == "count" else [])

    async def consume_message(self, shard: Any, store: SQLiteStore, envelope: Any, publisher: Publisher) -> None:
        prefix = _label(shard, "prefix")
        if _label(shard, "stage") == "split":
            parts = int(_label(shard, "parts"))
            words = [{"word": w} for w in envelope.message["line"].split()]

            def partition(msg: dict) -> str:
                return f"{prefix}/words/part-{zlib.crc32(msg['word'].encode()) % parts}"

            await publisher.publish_uncommitted(partition, *words)
            return
        word = envelope.message["word"]
        db = store.transaction()
        n = (db.execute("SELECT n FROM counts WHERE word = ?", (word,)).fetchone() or (0,))[0] + 1
        db.execute("INSERT INTO counts VALUES (?, ?) ON CONFLICT (word) DO UPDATE SET n = excluded.n", (word, n))
        await publisher.publish_uncommitted(f"{prefix}/counts", {"word": word, "n": n})

    async def finalize_txn(self, shard: Any, store: SQLiteStore, publisher: Publisher) -> None:
        pass


def journal_specs(prefix: str, parts: int, replication: int, recorded: bool = False) -> list[pb.JournalSpec]:
    """The journals; `recorded`: also the shards' recovery logs (`{prefix}/logs/{shard id}`)."""
    names = [f"{prefix}/{kind}/part-{i}" for kind in ("lines", "words") for i in range(parts)] + [f"{prefix}/counts"]
    specs = [spec_from_dict({"name": n, "replication": replication}) for n in names]
    if recorded:
        log = {"replication": replication, "labels": {"content-type": "application/x-recoverylog"}}
        specs += [spec_from_dict({"name": f"{prefix}/logs/{s.id}", **log}) for s in shard_specs(prefix, parts)]
    return specs


def shard_specs(prefix: str, parts: int, recorded: bool = False) -> list[pb.ShardSpec]:
    """The shards; `recorded`: their stores recorded to recovery logs, each with a hot standby."""
    extra = {"recovery_log_prefix": f"{prefix}/logs", "hot_standbys": 1} if recorded else {}
    specs = []
    for stage, source in (("split", "lines"), ("count", "words")):
        for i in range(parts):
            labels = {"stage": stage, "prefix": prefix, "parts": str(parts)}
            specs.append(
                shard_from_dict(
                    {
                        "id": f"{prefix}/{stage}/{i}",
                        "sources": [f"{prefix}/{source}/part-{i}"],
                        "labels": labels,
                        "max_txn_duration": "1s",
                        **extra,
                    }
                )
            )
    return specs


async def publish_lines(broker: str, prefix: str, parts: int, lines: int, seed: int) -> Counter:
    """Publish `lines` random lines, committed, spread over the lines partitions; the words published."""
    rng = random.Random(seed)
    counted: Counter = Counter()
    async with AsyncClient(broker) as c:
        publisher = Publisher(AppendService(c))
        for at in range(0, lines, 50):
            batch = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8))) for _ in range(min(50, lines - at))]
            for line in batch:
                counted.update(line.split())
            await (
                await publisher.publish_committed(
                    f"{prefix}/lines/part-{at // 50 % parts}", *({"line": x} for x in batch)
                )
            )
        await publisher.service.aclose()
    return counted


async def counts_published(broker: str, prefix: str) -> tuple[dict[str, int], list[str]]:
    """Each word's final count in `{prefix}/counts` (read committed), and what breaks exactly-once there."""
    seen: dict[str, list[int]] = {}
    async with AsyncClient(broker) as c:
        async for env in read_committed(c, f"{prefix}/counts", block=False):
            seen.setdefault(env.message["word"], []).append(env.message["n"])
    problems = [f"{w}: {ns[:10]}..." for w, ns in seen.items() if ns != list(range(1, len(ns) + 1))]
    return {w: len(ns) for w, ns in seen.items()}, problems


def main() -> None:
    ap = arguments(__doc__, "wc")
    ap.add_argument("--lines", type=int, default=2000)
    ap.add_argument(
        "--recorded", action="store_true", help="stores recorded to recovery logs, hot standbys; a consumer killed"
    )
    args = parse(ap)
    if args.recorded and args.consumers < 2:
        ap.error("--recorded kills a consumer mid-run: give --consumers 2 or more")
    with consumers("examples.wordcount:WordCount", args, "wc", own_dirs=args.recorded) as endpoints:
        asyncio.run(create(args.broker, endpoints[0], journal_specs(args.prefix, args.parts, args.replication,
                                                                    args.recorded),
                           shard_specs(args.prefix, args.parts, args.recorded)))  # fmt: skip
        started = time.monotonic()
        half = args.lines // 2 if args.recorded else args.lines
        expected = asyncio.run(publish_lines(args.broker, args.prefix, args.parts, half, args.seed))
        if args.recorded:
            wait_for(lambda: _all_in(_counted(args, endpoints), expected), 120, "counting the first half")
            endpoints.kill(0)
            print("killed a consumer (kill -9); its standbys take its shards over", flush=True)
            expected += asyncio.run(
                publish_lines(args.broker, args.prefix, args.parts, args.lines - half, args.seed + 1)
            )
        print(f"published {args.lines} lines, {sum(expected.values())} words", flush=True)
        counted: dict[str, int] = {}

        def all_counted() -> bool:
            counted.update(_counted(args, endpoints))
            return _all_in(counted, expected)

        wait_for(all_counted, 120, "counting every word")
        took = time.monotonic() - started
        for word, n in sorted(counted.items(), key=lambda kv: -kv[1]):
            print(f"{word:>10} {n}")
        if counted != dict(expected):
            raise SystemExit(f"counts differ from what was published: {counted} != {dict(expected)}")
        print(f"counted exactly once in {took:.1f}s")


def _counted(args: Any, endpoints: list[str]) -> dict[str, int]:
    """The counts published so far (a shard that failed, or counts not exactly once: SystemExit)."""
    failed = asyncio.run(failures(endpoints[0], args.prefix))
    if failed:
        raise SystemExit(f"a shard failed: {failed[0]}")
    return _checked(asyncio.run(counts_published(args.broker, args.prefix)))


def _all_in(counted: dict[str, int], expected: Counter) -> bool:
    return all(counted.get(w, 0) >= n for w, n in expected.items())


def _checked(result: tuple[dict[str, int], list[str]]) -> dict[str, int]:
    counted, problems = result
    if problems:
        raise SystemExit(f"not exactly once: {problems[:3]}")
    return counted


if __name__ == "__main__":
    main()
