"""consumer: consumer shards whose effects commit exactly once with their stores (Gazette's
consumer framework; seed: gazette-exactly-once.txt, "Consumer Shard Transaction Lifecycle", "Store
Fencing" and "Recovery Logs and Register Fencing").

- `store`: the Store interface a shard commits its Checkpoint through: `SQLiteStore` (a file per
  shard) and `PostgresStore` (a PostgreSQL database), whose fences stop a zombie primary.
- `store_recorded`: `RecordedSQLiteStore` and `JSONFileStore`, whose file writes are recorded to
  the shard's recovery log (`recoverylog/`: recorder, player, FSM, hints) so any process can play
  them back; `recovery`: a shard's recovery log on a process (played, tailed, handed off).
- `application`: the `Application` a user subclasses, and the `Shard` its hooks are given.
- `shard`: `serve_primary` runs a shard's pipelined transactions for an `Application` (restore the
  checkpoint, re-write its ACK intents, read sources committed, consume, commit the store with
  the checkpoint after the downstream appends, then write the ACKs); `transaction`: that loop.
- `service`: the consumer process (`tidings consumer`): shards assigned by the allocator, the
  Shard gRPC service, metrics; `replica`: its replica of one shard (primary, standby, statuses);
  `client`: ShardClient.

A shard with a recovery log keeps its store on each replica in a directory of the process's own:
replicas play the log (BACKFILL, then STANDBY: hot standbys), and the one that becomes primary hands
the log off to itself and records on (docs/shards.md, "Recorded stores"). Without one, a shard's
SQLite file lives in the process's --data-dir (the processes of one host share it) or its state in
PostgreSQL, and a failover restores from the store itself.

The shards themselves are items of the same allocator that places journals on brokers
(`tidings.allocator.kind.SHARDS`).
"""

from tidings.consumer.application import Application, Shard
from tidings.consumer.shard import serve_primary
from tidings.consumer.store import FenceError, PostgresStore, SQLiteStore, Store
from tidings.consumer.store_recorded import JSONFileStore, RecordedSQLiteStore, sqlite_store

__all__ = [
    "Application",
    "FenceError",
    "JSONFileStore",
    "PostgresStore",
    "RecordedSQLiteStore",
    "SQLiteStore",
    "Shard",
    "Store",
    "serve_primary",
    "sqlite_store",
]
