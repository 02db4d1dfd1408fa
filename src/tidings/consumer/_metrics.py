"""Prometheus metrics of a consumer process (served on its /metrics; every one is in the README).
Series are per shard: a consumer serves tens to thousands of shards, as Gazette's do."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, disable_created_metrics

disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus_client leaves it unannotated

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

TRANSACTIONS = Counter("tidings_shard_transactions_total", "Shard transactions committed and acknowledged.", ["shard"])
MESSAGES = Counter("tidings_shard_messages_total", "Source messages consumed by committed transactions.", ["shard"])
COMMIT_SECONDS = Histogram(
    "tidings_shard_commit_seconds",
    "From a transaction's close to its store commit (finalize_txn, the previous ACKs, the commit).",
    ["shard"],
    buckets=_SECONDS,
)
TXN_SECONDS = Histogram(
    "tidings_shard_transaction_seconds",
    "A transaction from its first message to its ACKs written.",
    ["shard"],
    buckets=_SECONDS,
)
READ_THROUGH = Gauge("tidings_shard_read_through", "A primary's read-through offset of a source.", ["shard", "journal"])
LAG_BYTES = Gauge(
    "tidings_shard_lag_bytes", "A source's write head less the primary's read-through offset.", ["shard", "journal"]
)
SHARD_FAILURES = Counter("tidings_shard_failures_total", "Shard primaries that stopped FAILED.")
RPC_STATUS = Counter(
    "tidings_consumer_rpc_status_total",
    "Shard service RPCs answered, by RPC (stat, list, apply, unassign) and Status (or gRPC code).",
    ["rpc", "status"],
)
