"""Fragments: the content-addressed files a journal is stored as.

Every span of journal content is a Fragment [begin, end) of a journal, named
``{begin:016x}-{end:016x}-{sha1 hex}{.raw|.gz|.zst}`` in the folder ``{store}{journal}/``.
The guarantee: **a fragment's name identifies and verifies its content** — any reader can check
the bytes it got against the SHA1 in the name, and two files with the same name hold the same
content, so persisting is idempotent and replicas never need to agree on anything but names.

Main types:

- `Fragment`, `parse_content_name`, `EMPTY_SUM` (fragment.py): the value and its pure naming.
- `codecs`: none / gzip / zstd, streamed in chunks.
- `FragmentStore`, `store_for` (store.py): persisted fragments in an fsspec store
  (file://, memory://, s3://...), written so no reader ever sees a partial file.
- `FragmentIndex` (index.py): a replica's union of local spool and persisted fragments;
  answers "which fragment covers offset N" in O(log n) and wakes readers as content commits.
- `Persister` (persister.py): the broker's named background loop that uploads completed
  fragments, retrying with backoff and never dropping one.
- `Spool` (spool.py): the replica's transactional memory of its journal, a state machine.
- `retention` (retention.py): which persisted fragments a journal's retention lets go (an aged
  prefix, never the newest), for the brokers' schedule and `journals prune`.

Seed: gazette-transactional-appends.txt, *Components* (Fragment, Spool, persisting).
Metrics (fragment/_metrics.py): tidings_fragments_persisted_total,
tidings_fragment_persist_failures_total, tidings_fragment_persisted_bytes_total,
tidings_fragments_pruned_total, tidings_fragment_pruned_bytes_total.

Blocking work (file I/O, compression, store calls) belongs in `asyncio.to_thread`; the store and
codec functions block, the index and persister do not.
"""

from __future__ import annotations

import importlib
from typing import Any

# Exports load on first use (PEP 562): a client reading fragments needs `Fragment`, not fsspec,
# the persister or prometheus_client (`tidings --help` and short CLI commands start faster).
_EXPORTS = {
    "EMPTY_SUM": "tidings.fragment.fragment",
    "Fragment": "tidings.fragment.fragment",
    "parse_content_name": "tidings.fragment.fragment",
    "FragmentIndex": "tidings.fragment.index",
    "FragmentStore": "tidings.fragment.store",
    "store_for": "tidings.fragment.store",
    "Persister": "tidings.fragment.persister",
    "PersisterStatistics": "tidings.fragment.persister",
}

__all__ = [
    "EMPTY_SUM",
    "Fragment",
    "FragmentIndex",
    "FragmentStore",
    "Persister",
    "PersisterStatistics",
    "codecs",
    "parse_content_name",
    "store_for",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in ("codecs", "retention", "spool", "_metrics", "index", "store", "persister", "fragment"):
        return importlib.import_module(f"tidings.fragment.{name}")
    raise AttributeError(f"module 'tidings.fragment' has no attribute {name!r}")
