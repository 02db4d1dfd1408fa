"""Stream sum, exactly once: many producers' streams of random numbers, summed per stream.

Producers publish each stream as chunks ``{"stream": id, "seq": k, "numbers": [...], "last": bool}``
to `{prefix}/chunks/part-N` (a stream keeps to one part, so its chunks arrive in order). The `sum/N`
shards keep each stream's next seq and running sum in their store (SQLite, a file per shard; or
PostgreSQL), and publish ``{"stream": id, "sum": s, "chunks": n}`` to `{prefix}/sums` with a
stream's last chunk. A chunk out of sequence (a duplicate or a gap: exactly-once broken) fails the
shard. The verifier reads `{prefix}/sums` committed: every stream once, with the sum its producer
computed, so every number was counted exactly once.

The application keeps a transaction's changes in its store's `cache` and writes them in
`finalize_txn`, a statement per transaction rather than per message (what makes PostgreSQL fast).

Run it against `tidings cluster up` (its `etcd` line gives --etcd)::

    .venv/bin/python -m examples.stream_sum --etcd 127.0.0.1:PORT
    .venv/bin/python -m examples.stream_sum --etcd 127.0.0.1:PORT --postgres   # a private PostgreSQL
    .venv/bin/python -m examples.stream_sum --etcd 127.0.0.1:PORT --postgres postgresql://...

It creates the journals and shards, starts `tidings consumer` processes serving this module's
`Summer`, runs the producers, waits until every stream's sum is published, verifies them, and
stops the consumers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import random
import zlib
from typing import Any

from examples._consumers import arguments, consumers, create, failures, parse, wait_for

from tidings.client import AppendService, AsyncClient
from tidings.consumer import Application, PostgresStore, SQLiteStore
from tidings.message import Publisher, read_committed
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.specs import shard_from_dict, spec_from_dict

POSTGRES_ENV = "STREAM_SUM_POSTGRES"  # a PostgreSQL URL: the shards' store (else SQLite files)
SUMS = (
    "CREATE TABLE IF NOT EXISTS stream_sums (shard TEXT NOT NULL, stream TEXT NOT NULL, seq BIGINT NOT NULL, "
    "total BIGINT NOT NULL, done BOOLEAN NOT NULL, PRIMARY KEY (shard, stream))"
)
UPSERT = (
    "INSERT INTO stream_sums (shard, stream, seq, total, done) VALUES ({p}, {p}, {p}, {p}, {p}) "
    "ON CONFLICT (shard, stream) DO UPDATE SET seq = excluded.seq, total = excluded.total, done = excluded.done"
)
SELECT = "SELECT seq, total, done FROM stream_sums WHERE shard = {p} AND stream = {p}"


class OutOfSequence(Exception):
    """A chunk that is not its stream's next: exactly-once is broken (the shard fails)."""


@dataclasses.dataclass(slots=True)
class Stream:
    seq: int = 0  # the next chunk's
    total: int = 0
    done: bool = False


def _label(shard: Any, name: str) -> str:
    return next((lb.value for lb in shard.spec.labels.labels if lb.name == name), "")


class Summer(Application):
    """The application (`tidings consumer --app examples.stream_sum:Summer`)."""

    def new_store(self, shard: Any) -> SQLiteStore | PostgresStore:
        dsn = os.environ.get(POSTGRES_ENV)
        return PostgresStore(dsn, schema=[SUMS]) if dsn else SQLiteStore(shard.path(), schema=[SUMS])

    async def begin_txn(self, shard: Any, store: Any) -> None:
        store.cache = {}  # stream -> Stream: this transaction's changes, written by finalize_txn

    async def consume_message(self, shard: Any, store: Any, envelope: Any, publisher: Publisher) -> None:
        msg = envelope.message
        stream = store.cache.get(msg["stream"]) or await self._load(shard, store, msg["stream"])
        if stream.done or msg["seq"] != stream.seq:
            raise OutOfSequence(
                f"stream {msg['stream']}: chunk {msg['seq']} at {envelope.journal}:{envelope.begin}, "
                f"expected {'none (it ended)' if stream.done else stream.seq}: not exactly once"
            )
        stream.seq += 1
        stream.total += sum(msg["numbers"])
        stream.done = bool(msg["last"])
        store.cache[msg["stream"]] = stream
        if stream.done:
            out = {"stream": msg["stream"], "sum": stream.total, "chunks": stream.seq}
            await publisher.publish_uncommitted(f"{_label(shard, 'prefix')}/sums", out)

    async def _load(self, shard: Any, store: Any, stream: str) -> Stream:
        key = (shard.spec.id, stream)
        if isinstance(store, PostgresStore):
            row = await (await store.transaction().execute(SELECT.format(p="%s"), key)).fetchone()
        else:
            row = store.transaction().execute(SELECT.format(p="?"), key).fetchone()
        return Stream(*row) if row else Stream()

    async def finalize_txn(self, shard: Any, store: Any, publisher: Publisher) -> None:
        rows = [(shard.spec.id, name, s.seq, s.total, s.done) for name, s in store.cache.items()]
        if isinstance(store, PostgresStore):
            async with store.transaction().cursor() as cur:
                await cur.executemany(UPSERT.format(p="%s"), rows)
        else:
            store.transaction().executemany(UPSERT.format(p="?"), rows)
        store.cache = {}


def journal_specs(prefix: str, parts: int, replication: int) -> list[pb.JournalSpec]:
    names = [f"{prefix}/chunks/part-{i}" for i in range(parts)] + [f"{prefix}/sums"]
    return [spec_from_dict({"name": n, "replication": replication}) for n in names]


def shard_specs(prefix: str, parts: int) -> list[pb.ShardSpec]:
    return [
        shard_from_dict(
            {
                "id": f"{prefix}/sum/{i}",
                "sources": [f"{prefix}/chunks/part-{i}"],
                "labels": {"prefix": prefix},
                "max_txn_duration": "1s",
            }
        )
        for i in range(parts)
    ]


async def produce(broker: str, prefix: str, parts: int, producers: int, streams: int, chunks: int, seed: int) -> dict:
    """`producers` concurrent producers, each publishing its share of `streams` streams of `chunks`
    chunks of random numbers, a round of chunks at a time; returns each stream's sum."""
    sums: dict[str, int] = {}

    async def producer(p: int) -> None:
        rng = random.Random(seed * 1000 + p)
        mine = [f"p{p}-s{s}" for s in range(p, streams, producers)]
        async with AsyncClient(broker) as c:
            publisher = Publisher(AppendService(c))
            for seq in range(chunks):
                by_journal: dict[str, list[dict]] = {}
                for stream in mine:
                    numbers = [rng.randrange(1_000_000) for _ in range(rng.randint(1, 32))]
                    sums[stream] = sums.get(stream, 0) + sum(numbers)
                    journal = f"{prefix}/chunks/part-{zlib.crc32(stream.encode()) % parts}"
                    chunk = {"stream": stream, "seq": seq, "numbers": numbers, "last": seq == chunks - 1}
                    by_journal.setdefault(journal, []).append(chunk)
                done = [await publisher.publish_committed(j, *msgs) for j, msgs in by_journal.items()]
                await asyncio.gather(*done)  # (a stream's next chunk only once this one is committed)
            await publisher.service.aclose()

    await asyncio.gather(*(producer(p) for p in range(producers)))
    return sums


async def published_sums(broker: str, prefix: str) -> tuple[dict[str, tuple[int, int]], list[str]]:
    """Each stream's (sum, chunks) in `{prefix}/sums` (read committed), and the streams seen twice."""
    seen: dict[str, tuple[int, int]] = {}
    twice = []
    async with AsyncClient(broker) as c:
        async for env in read_committed(c, f"{prefix}/sums", block=False):
            m = env.message
            if m["stream"] in seen:
                twice.append(m["stream"])
            seen[m["stream"]] = (m["sum"], m["chunks"])
    return seen, twice


def main() -> None:
    ap = arguments(__doc__, "sum")
    ap.add_argument("--producers", type=int, default=8)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--chunks", type=int, default=10, help="per stream")
    ap.add_argument("--postgres", nargs="?", const="private", default="",
                    help="keep the sums in PostgreSQL: this URL, or a private server if none")  # fmt: skip
    args = parse(ap)
    with contextlib.ExitStack() as stack:
        env = {}
        if args.postgres == "private":
            from tidings.cluster.postgres import PostgresProcess

            env[POSTGRES_ENV] = stack.enter_context(PostgresProcess()).dsn()
        elif args.postgres:
            env[POSTGRES_ENV] = args.postgres
        endpoints = stack.enter_context(consumers("examples.stream_sum:Summer", args, "sum", env))
        asyncio.run(create(args.broker, endpoints[0], journal_specs(args.prefix, args.parts, args.replication),
                           shard_specs(args.prefix, args.parts)))  # fmt: skip
        expected = asyncio.run(
            produce(args.broker, args.prefix, args.parts, args.producers, args.streams, args.chunks, args.seed)
        )
        print(f"{args.producers} producers published {args.streams} streams of {args.chunks} chunks", flush=True)

        def verified() -> bool:
            failed = asyncio.run(failures(endpoints[0], args.prefix))
            if failed:
                raise SystemExit(f"a shard failed: {failed[0]}")
            seen, twice = asyncio.run(published_sums(args.broker, args.prefix))
            wrong = [s for s, (total, n) in seen.items() if (total, n) != (expected.get(s), args.chunks)]
            if twice or wrong:
                raise SystemExit(f"not exactly once: published twice {twice[:3]}, wrong sums {wrong[:3]}")
            return len(seen) == len(expected)

        wait_for(verified, 120, "summing every stream")
        store = "PostgreSQL" if env else "SQLite"
        print(f"verified: {len(expected)} streams summed exactly once ({store} stores)")


if __name__ == "__main__":
    main()
