"""Prometheus metrics of the broker (served on each broker's /metrics; every one is in the README).

Counters count events; gauges are set by each broker every `GAUGE_INTERVAL` seconds from its own
state, as its contribution (brokers sharing a process, as in tests, add up). Per-journal series
exist only with `tidings broker --metrics-journals` (one series per journal: mind the cardinality).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, disable_created_metrics

# (no `_created` twin of every counter: half the lines, none of them read)
disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus_client leaves it unannotated

APPENDED_BYTES = Counter("tidings_appended_bytes_total", "Bytes committed by clients' appends at this primary.")
COMMITS = Counter("tidings_commits_total", "Clients' appends committed at this primary (every replica acknowledged).")
PULSES = Counter("tidings_pulses_total", "The primary's own zero-byte health-check appends committed (not clients').")
ROLLBACKS = Counter("tidings_rollbacks_total", "Appends rolled back (aborted, stalled or refused).")
APPEND_SECONDS = Histogram(
    "tidings_append_seconds",
    "Clients' appends at this primary, from their first message to their commit.",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
PIPELINE_STARTS = Counter("tidings_pipeline_starts_total", "Replication pipelines built.")
PIPELINE_RESYNCS = Counter("tidings_pipeline_resyncs_total", "Pipeline syncs repeated after a peer mismatch.")
READ_BYTES = Counter("tidings_read_bytes_total", "Content bytes served by Read.")
RPC_STATUS = Counter(
    "tidings_rpc_status_total",
    "Broker RPCs answered, by RPC (append, read, list, apply, list_fragments, list_members) and Status "
    "(or the gRPC code of an RPC that failed).",
    ["rpc", "status"],
)

JOURNAL_APPENDED_BYTES = Counter(
    "tidings_journal_appended_bytes_total", "Per journal (--metrics-journals): bytes committed by clients.", ["journal"]
)
JOURNAL_COMMITS = Counter(
    "tidings_journal_commits_total", "Per journal (--metrics-journals): clients' appends committed.", ["journal"]
)
THROTTLED_SECONDS = Counter(
    "tidings_append_throttled_seconds_total",
    "Seconds appends' chunks waited for their journal's max_append_rate (or --max-append-rate): flow control.",
)
THROTTLED_CHUNKS = Counter("tidings_append_throttled_chunks_total", "Appends' chunks that waited for their rate.")
JOURNAL_THROTTLED_SECONDS = Counter(
    "tidings_journal_append_throttled_seconds_total",
    "Per journal (--metrics-journals): seconds its appends waited for its rate.",
    ["journal"],
)
JOURNAL_READ_BYTES = Counter(
    "tidings_journal_read_bytes_total", "Per journal (--metrics-journals): content bytes served by Read.", ["journal"]
)

JOURNALS = Gauge("tidings_journals", "Journal replicas this broker holds.")
PRIMARIES = Gauge("tidings_primaries", "Journals this broker is the primary of.")
PIPELINES = Gauge("tidings_pipelines", "Replication pipelines this broker's primaries hold open.")
PERSIST_QUEUE = Gauge(
    "tidings_persist_queue_fragments", "Fragments waiting to be persisted (delayed, queued or retrying)."
)
STORES_UNHEALTHY = Gauge(
    "tidings_store_unhealthy_journals", "Journal replicas whose latest listing of their fragment stores failed."
)
GAUGE_INTERVAL = 2.0
