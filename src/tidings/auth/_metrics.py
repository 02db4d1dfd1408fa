"""The refusals' metric, on every server that verifies tokens (loaded by `Verifier`: clients load no metrics)."""

from __future__ import annotations

from prometheus_client import Counter, disable_created_metrics

disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus_client leaves it unannotated

REFUSALS = Counter(
    "tidings_auth_refusals_total",
    "Requests refused by their token, by service (journal, shard, target) and what the caller got: "
    "UNAUTHENTICATED (no valid token), PERMISSION_DENIED (a token lacking the capability, an Apply outside its "
    "selector), or JOURNAL_NOT_FOUND, SHARD_NOT_FOUND, TARGET_NOT_FOUND (a journal, shard or target outside its "
    "selector, answered as missing).",
    ["service", "code"],
)
