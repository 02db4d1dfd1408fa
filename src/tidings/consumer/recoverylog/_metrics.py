"""Prometheus metrics of recovery logs (served on a consumer's /metrics; every one is in the README).
Counters are per log (one per shard: `{recovery_log_prefix}/{shard id}`)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

RECORDED_BYTES = Counter(
    "tidings_recoverylog_recorded_bytes_total", "Bytes a recorder appended to a recovery log (framed ops).", ["log"]
)
RECORDED_OPS = Counter("tidings_recoverylog_recorded_ops_total", "Operations a recorder appended.", ["log"])
PLAYED_BYTES = Counter("tidings_recoverylog_played_bytes_total", "Recovery-log bytes a player read.", ["log"])
ROLLOVERS = Counter("tidings_recoverylog_rollovers_total", "Recorded databases rolled over to a new file.", ["log"])
HINTS_WRITTEN = Counter(
    "tidings_recoverylog_hints_written_total",
    "Hints stored in etcd: `recovered` (a new primary's, once restored) and `recorded` (its recorder's, "
    "every HINT_INTERVAL).",
    ["kind"],
)
PLAYBACK_SECONDS = Histogram(
    "tidings_recoverylog_playback_seconds",
    "A replica's playback from its start to its catching up with the log's write head.",
    buckets=_SECONDS,
)
HANDOFF_SECONDS = Histogram(
    "tidings_recoverylog_handoff_seconds",
    "A promoted replica: from asking its playback to finish (the handoff) to its store restored.",
    buckets=_SECONDS,
)
LAG_BYTES = Gauge(
    "tidings_recoverylog_lag_bytes",
    "A replica's recovery log: its write head less the offset the replica has played (a standby) or "
    "recorded (a primary) through.",
    ["shard"],
)
