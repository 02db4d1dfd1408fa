"""Prometheus metrics of the fragment package (registered once, in the default registry)."""

from __future__ import annotations

from prometheus_client import Counter

FRAGMENTS_PERSISTED = Counter(
    "tidings_fragments_persisted_total",
    "Fragments persisted to a fragment store (including ones found already there).",
)
FRAGMENT_PERSIST_FAILURES = Counter(
    "tidings_fragment_persist_failures_total",
    "Failed attempts to persist a fragment; each is retried with backoff.",
)
FRAGMENT_PERSISTED_BYTES = Counter(
    "tidings_fragment_persisted_bytes_total",
    "Raw (uncompressed) content bytes of persisted fragments.",
)
FRAGMENTS_PRUNED = Counter(
    "tidings_fragments_pruned_total",
    "Persisted fragments this broker removed as their journal's retention let them go.",
)
FRAGMENT_PRUNED_BYTES = Counter(
    "tidings_fragment_pruned_bytes_total",
    "Raw (uncompressed) content bytes of the fragments retention removed.",
)
