"""The client of a tidings cluster (gazette-transactional-appends.txt; Gazette's broker/client).

* `AsyncClient` (asyncio, grpc.aio) and `Client`, its synchronous facade with the same methods.
  Both keep a Route cache fed by response headers, so appends go straight to a journal's primary
  and reads to a replica in the client's zone; transient statuses and unreachable brokers are
  retried with backoff, and definite refusals raise the `StatusError` subclass naming the journal
  and status (`tidings.protocol.status`). With `auth` (`tidings.auth`: a token or keys) every call
  carries the token its claims need; a refusal (`UnauthenticatedError`, `NotAllowedError`) is definite.
* `Appender`: one streamed append; as a context manager it commits on success and rolls back on
  an exception.
* `Reader`: content from an offset, surviving broker restarts and Route changes, reporting offset
  jumps, optionally reading persisted fragments straight from their store.
* `AppendService`: batched appends with a future per append, ordered per journal, spilled to a
  temporary file beyond a memory threshold, retried until committed, with back-pressure; an append
  may depend on others (in any journal) committing first; it appends through its client (and its
  `auth`). A definite failure (a refusal of its token too) stops its journal:
  `EarlierAppendFailedError`, `DependencyFailedError`, `AppendOutcomeUnknownError`.

Modules: `_base` (results, Route cache, retry policy: no I/O), `_async`, `_append_service`, `_sync`.
"""

from tidings.client._append_service import (
    AppendOutcomeUnknownError,
    AppendService,
    AppendServiceStatistics,
    DependencyFailedError,
    EarlierAppendFailedError,
)
from tidings.client._async import Appender, AsyncClient, Reader
from tidings.client._base import AppendResult, ReadChunk, RetryPolicy, RouteCache
from tidings.client._sync import Client, SyncAppender, SyncReader

__all__ = [
    "AppendOutcomeUnknownError",
    "AppendResult",
    "AppendService",
    "AppendServiceStatistics",
    "Appender",
    "AsyncClient",
    "Client",
    "DependencyFailedError",
    "EarlierAppendFailedError",
    "ReadChunk",
    "Reader",
    "RetryPolicy",
    "RouteCache",
    "SyncAppender",
    "SyncReader",
]

for _name in __all__:
    globals()[_name].__module__ = __name__
