"""consumer: consumer shards whose effects commit exactly once with their stores (Gazette's
consumer framework; seed: gazette-exactly-once.txt, "Consumer Shard Transaction Lifecycle" and
"Store Fencing"). Being built in steps (issue 10):

- `store`: the Store interface a shard commits its Checkpoint through, and `SQLiteStore`, whose
  fence stops a zombie primary's commits.

The shards themselves are items of the same allocator that places journals on brokers
(`tidings.allocator.kind.SHARDS`).
"""

from tidings.consumer.store import FenceError, SQLiteStore, Store

__all__ = ["FenceError", "SQLiteStore", "Store"]
