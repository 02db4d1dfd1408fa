"""Fragments written into a journal's store as another broker would have (stale or foreign content)."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from tidings.fragment.fragment import Fragment
from tidings.fragment.store import store_for
from tidings.protocol import protocol_pb2 as pb


def write_foreign_fragment(
    cluster, journal: str, begin: int, content: bytes, codec: str = "none", age: float = 0.0
) -> None:
    """Persist a fragment into the journal's store as another, disconnected broker would have,
    `age` seconds ago (its file's modification time in the file:// store)."""
    codecs = {"none": pb.NONE, "gzip": pb.GZIP, "zstd": pb.ZSTANDARD}
    frag = Fragment(
        journal=journal, begin=begin, end=begin + len(content), sum=hashlib.sha1(content).digest(), codec=codecs[codec]
    )
    path = cluster.data_dir / f"foreign-{begin}.raw"
    path.write_bytes(content)
    store = store_for(cluster.store_url)
    store.persist(frag, str(path))
    if age:
        stored = Path(store.url(frag).removeprefix("file://"))
        then = time.time() - age
        os.utime(stored, (then, then))
