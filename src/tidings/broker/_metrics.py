"""Prometheus metrics of the broker (served on each broker's /metrics)."""

from prometheus_client import Counter

APPENDED_BYTES = Counter("tidings_appended_bytes_total", "Bytes committed by appends at this primary.")
COMMITS = Counter("tidings_commits_total", "Appends committed (acknowledged by every replica).")
ROLLBACKS = Counter("tidings_rollbacks_total", "Appends rolled back (aborted, stalled or refused).")
PIPELINE_STARTS = Counter("tidings_pipeline_starts_total", "Replication pipelines built.")
PIPELINE_RESYNCS = Counter("tidings_pipeline_resyncs_total", "Pipeline syncs repeated after a peer mismatch.")
READ_BYTES = Counter("tidings_read_bytes_total", "Content bytes served by Read.")
RPC_STATUS = Counter("tidings_rpc_status_total", "Broker RPC outcomes by RPC and Status.", ["rpc", "status"])
