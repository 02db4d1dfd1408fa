"""consumer: consumer shards whose effects commit exactly once with their stores (Gazette's
consumer framework; seed: gazette-exactly-once.txt, "Consumer Shard Transaction Lifecycle" and
"Store Fencing"). Being built in steps (issue 10):

- `store`: the Store interface a shard commits its Checkpoint through: `SQLiteStore` (a file per
  shard) and `PostgresStore` (a PostgreSQL database), whose fences stop a zombie primary.
- `application`: the `Application` a user subclasses, and the `Shard` its hooks are given.
- `shard`: `serve_primary` runs a shard's pipelined transactions for an `Application` (restore the
  checkpoint, re-write its ACK intents, read sources committed, consume, commit the store with
  the checkpoint after the downstream appends, then write the ACKs).
- `service`: the consumer process (`tidings consumer`): shards assigned by the allocator, the
  Shard gRPC service, metrics; `client`: ShardClient.

Stores are not recorded: a shard's SQLite file lives in the process's --data-dir (the processes of
one host share it) or its state in PostgreSQL, so a standby has nothing to tail and a failover
restores from the store itself.

The shards themselves are items of the same allocator that places journals on brokers
(`tidings.allocator.kind.SHARDS`).
"""

from tidings.consumer.application import Application, Shard
from tidings.consumer.shard import serve_primary
from tidings.consumer.store import FenceError, PostgresStore, SQLiteStore, Store

__all__ = ["Application", "FenceError", "PostgresStore", "SQLiteStore", "Shard", "Store", "serve_primary"]
