"""consumer: consumer shards whose effects commit exactly once with their stores (Gazette's
consumer framework; seed: gazette-exactly-once.txt, "Consumer Shard Transaction Lifecycle" and
"Store Fencing"). Being built in steps (issue 10):

- `store`: the Store interface a shard commits its Checkpoint through, and `SQLiteStore`, whose
  fence stops a zombie primary's commits.
- `shard`: `serve_primary` runs a shard's transactions for an `Application` (restore the
  checkpoint, re-write its ACK intents, read sources committed, consume, commit the store with
  the checkpoint after the downstream appends, then write the ACKs).

Still to come (issue 10): pipelined transactions, waiting for an expected ACK, the consumer
process with its Shard service and assignments from the allocator, PostgreSQL, the CLI.

The shards themselves are items of the same allocator that places journals on brokers
(`tidings.allocator.kind.SHARDS`).
"""

from tidings.consumer.shard import Application, Shard, serve_primary
from tidings.consumer.store import FenceError, SQLiteStore, Store

__all__ = ["Application", "FenceError", "SQLiteStore", "Shard", "Store", "serve_primary"]
