#!/usr/bin/env python3
"""The paper's alternative WAL design (logplayer-paper.txt, section 5, Figure 8), built from tidings'
own parts for `bench/logplayer.py --design relay`: one child process per consumer shard.

- `relay` (the paper's "Kafka player"): a consumer shard reading the WAL journal committed and
  re-publishing each entry's part for target T to the journal `{prefix}/T`, in the shard's
  transaction: the parts become visible (ACKs) only once the shard's store committed its
  checkpoint, so each part is published exactly once whatever crashes.
- `apply` (a storage shard): a consumer shard reading its target journal committed and applying
  each part to its key-value table, the read offsets committed with it (SQLite store): exactly once.

Each prints READY once its store is restored and serving, and stops (committing what it has) when
its stdin closes. The apply shards log each part as LogPlayer targets do (`applied` table:
index, mutations, committed_ns, dispatched_ns, received_ns), so one reader measures both designs.

  bench/_relay.py relay --broker HOST:PORT --source WAL --db FILE --prefix PREFIX
  bench/_relay.py apply --broker HOST:PORT --source JOURNAL --db FILE
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import msgspec
import uvloop

from tidings.client import AsyncClient
from tidings.consumer import Application, Shard, SQLiteStore, serve_primary
from tidings.logplayer.target import APPLIED_TABLE, KV_TABLE, apply_key_values
from tidings.logplayer.wal import WalEntry, WalMutation
from tidings.protocol import protocol_pb2 as pb


class Part(msgspec.Struct, omit_defaults=True):
    """One target's part of a WAL entry, as the relay publishes it to the target's journal."""

    index: int = 0  # the WAL entry's index (its offset in the WAL journal)
    mutations: list[WalMutation] = []
    committed_ns: int = 0  # when the transaction manager appended the entry
    dispatched_ns: int = 0  # when the relay consumed it (the LogPlayer's dispatch time)
    uuid: str = ""


class Relay(Application):
    """Consumer application: the WAL's entries -> per-target journals, exactly once."""

    def __init__(self, db: str, prefix: str) -> None:
        self.db, self.prefix = db, prefix

    def new_store(self, shard: Shard) -> SQLiteStore:
        return SQLiteStore(self.db)

    def new_message(self, spec: pb.JournalSpec) -> type:
        return WalEntry

    async def consume_message(self, shard, store, envelope, publisher) -> None:
        now = time.time_ns()
        entry: WalEntry = envelope.message
        for target, mutations in entry.parts.items():
            part = Part(envelope.begin, mutations, entry.committed_ns, now)
            await publisher.publish_uncommitted(f"{self.prefix}/{target}", part)

    async def finalize_txn(self, shard, store, publisher) -> None:
        pass


class Apply(Application):
    """Consumer application: a storage shard applying its parts with its read offsets, exactly once."""

    def __init__(self, db: str) -> None:
        self.db = db

    def new_store(self, shard: Shard) -> SQLiteStore:
        return SQLiteStore(self.db, schema=[KV_TABLE, APPLIED_TABLE])  # (a LogPlayer target's tables)

    def new_message(self, spec: pb.JournalSpec) -> type:
        return Part

    def consume_message(self, shard, store, envelope, publisher) -> None:
        received = time.time_ns()
        part: Part = envelope.message
        db = store.transaction()
        apply_key_values(db, part)  # (a target's default apply: raw JSON values bind as they are)
        db.execute(
            "INSERT INTO applied (idx, mutations, committed_ns, dispatched_ns, received_ns) VALUES (?, ?, ?, ?, ?)",
            (part.index, len(part.mutations), part.committed_ns, part.dispatched_ns, received),
        )

    def finalize_txn(self, shard, store, publisher) -> None:
        pass


async def serve(args: argparse.Namespace) -> None:
    app = Relay(args.db, args.prefix) if args.role == "relay" else Apply(args.db)
    spec = pb.ShardSpec(
        id=f"bench/{args.role}/{args.source}",
        sources=[pb.ShardSpec.Source(journal=args.source)],
        max_txn_duration_ms=args.max_txn_ms,
    )
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    fd = sys.stdin.fileno()
    loop.add_reader(fd, lambda: os.read(fd, 4096) or stop.set())  # stdin closed: stop
    async with AsyncClient(args.broker) as client:
        shard = Shard(spec, client)
        task = asyncio.ensure_future(serve_primary(client, spec, app, stop, shard))
        restored = asyncio.ensure_future(shard.restored.wait())
        await asyncio.wait([task, restored], return_when=asyncio.FIRST_COMPLETED)
        if restored.done():
            print("READY", flush=True)
        await task


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("role", choices=["relay", "apply"])
    ap.add_argument("--broker", required=True)
    ap.add_argument("--source", required=True, help="the journal the shard reads")
    ap.add_argument("--db", required=True, help="the shard's SQLite store")
    ap.add_argument("--prefix", default="", help="relay: the target journals' prefix")
    ap.add_argument("--max-txn-ms", type=int, default=1000)
    uvloop.run(serve(ap.parse_args()))


if __name__ == "__main__":
    main()
