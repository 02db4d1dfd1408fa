"""Fragment store conformance suite: every fsspec store must pass it (file:// and memory:// here).

A store's guarantee is that a fragment's name identifies and verifies its content: what a
reader opens is exactly the content the name's SHA1 covers, and no reader ever sees a part of it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest

from tidings.fragment import Fragment, FragmentStore, codecs, store_for
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import ValidationError

JOURNAL = "examples/orders"
PAYLOAD_SIZE = 3 * 1024 * 1024 + 12345  # several chunks, not a chunk multiple


@pytest.fixture(params=["file", "memory"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "file":
        yield f"file://{tmp_path / 'store'}/"
    else:
        name = f"tidings-test-{uuid.uuid4().hex[:12]}"
        yield f"memory://{name}/"
        fs = fsspec.filesystem("memory")
        if fs.exists(f"/{name}"):
            fs.rm(f"/{name}", recursive=True)


def _write_local(tmp_path: Path, payload: bytes, begin: int = 0, trailing: bytes = b"") -> tuple[Fragment, str]:
    """A spool-like local file (content from offset 0, maybe uncommitted bytes after it)."""
    path = tmp_path / f"spool-{uuid.uuid4().hex[:8]}"
    path.write_bytes(payload + trailing)
    frag = Fragment(JOURNAL, begin, begin + len(payload), hashlib.sha1(payload).digest())
    return frag, str(path)


def _read_all(store: FragmentStore, frag: Fragment) -> tuple[bytes, int]:
    """Read the fragment in chunks; return its SHA1 and the largest chunk seen."""
    sha, largest, total = hashlib.sha1(), 0, 0
    with store.open(frag) as reader:
        while chunk := reader.read(codecs.CHUNK_SIZE):
            largest = max(largest, len(chunk))
            total += len(chunk)
            sha.update(chunk)
    assert total == frag.content_length
    return sha.digest(), largest


@pytest.mark.parametrize("codec", [pb.NONE, pb.GZIP, pb.ZSTANDARD], ids=["none", "gzip", "zstd"])
def test_persisted_content_matches_its_name(store_url: str, tmp_path: Path, codec: int) -> None:
    # Half random, half compressible: both paths through each codec.
    payload = os.urandom(PAYLOAD_SIZE // 2) + b"abcdefgh" * (PAYLOAD_SIZE // 16)
    raw, path = _write_local(tmp_path, payload, begin=1 << 40, trailing=b"uncommitted bytes past the end")
    frag = Fragment(raw.journal, raw.begin, raw.end, raw.sum, codec)
    store = FragmentStore(store_url)

    persisted = store.persist(frag, path)

    assert persisted == frag.with_store(store.store_url)
    digest, largest = _read_all(store, persisted)
    assert digest == frag.sum
    assert largest <= codecs.CHUNK_SIZE
    assert store.url(frag) == f"{store.store_url}{JOURNAL}/{frag.content_name()}"
    with fsspec.open(store.url(frag), "rb") as f:  # the URL is fetchable as-is
        assert codecs.decompress_reader(f, codec, closefd=False).read(16) == payload[:16]


def test_list_returns_valid_fragments_and_skips_garbage(
    store_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = FragmentStore(store_url)
    assert store.list(JOURNAL) == [], "a journal with no folder has no fragments"
    frags = []
    for begin, codec in [(100, pb.GZIP), (0, pb.NONE), (200, pb.ZSTANDARD)]:
        raw, path = _write_local(tmp_path, os.urandom(100), begin)
        frags.append(store.persist(Fragment(raw.journal, raw.begin, raw.end, raw.sum, codec), path))
    store.fs.pipe(f"{store._dir(JOURNAL)}/not-a-fragment.txt", b"garbage")
    store.fs.makedirs(f"{store._dir(JOURNAL)}/child", exist_ok=True)
    store.fs.pipe(f"{store._dir(JOURNAL)}/child/0000000000000000-0000000000000001-{'0' * 40}.raw", b"x")

    with caplog.at_level(logging.WARNING, logger="tidings.fragment.store"):
        listed = store.list(JOURNAL)

    assert [(f.begin, f.end, f.sum, f.codec) for f in listed] == sorted((f.begin, f.end, f.sum, f.codec) for f in frags)
    assert all(f.backing_store == store.store_url and f.mod_time > 0 for f in listed)
    assert "not-a-fragment.txt" in caplog.text
    assert store.list(f"{JOURNAL}/child")[0].end == 1, "a child journal's folder is its own"


def test_repersist_is_idempotent(store_url: str, tmp_path: Path) -> None:
    store = FragmentStore(store_url)
    frag, path = _write_local(tmp_path, os.urandom(5000))
    first = store.persist(frag, path)
    os.remove(path)  # the content is already there: the local file is not even read again
    assert store.persist(frag, path) == first
    assert len(store.list(JOURNAL)) == 1
    assert _read_all(store, frag)[0] == frag.sum


def test_mismatched_content_leaves_nothing(store_url: str, tmp_path: Path) -> None:
    store = FragmentStore(store_url)
    good, path = _write_local(tmp_path, os.urandom(PAYLOAD_SIZE))
    too_long = Fragment(JOURNAL, 0, good.end + 10, good.sum)  # the file ends early, mid-stream
    wrong_sum = Fragment(JOURNAL, 0, good.end, hashlib.sha1(b"other").digest())
    for frag, why in [(too_long, "bytes short"), (wrong_sum, "has SHA1")]:
        with pytest.raises(ValidationError, match=why):
            store.persist(frag, path)
    assert store.list(JOURNAL) == []
    folder = store._dir(JOURNAL)
    assert not store.fs.exists(folder) or store.fs.ls(folder) == [], "no temporary file is left behind"


def test_reader_never_sees_a_partial_file(store_url: str, tmp_path: Path) -> None:
    store = FragmentStore(store_url)
    frag, path = _write_local(tmp_path, os.urandom(4 * PAYLOAD_SIZE))
    frag = Fragment(frag.journal, frag.begin, frag.end, frag.sum, pb.GZIP)  # slow enough to overlap
    done = threading.Event()
    seen: list[Fragment] = []

    def persist() -> None:
        try:
            store.persist(frag, path)
        finally:
            done.set()

    writer = threading.Thread(target=persist)
    writer.start()
    while not done.is_set():
        for listed in store.list(JOURNAL):
            seen.append(listed)
            assert _read_all(store, listed)[0] == frag.sum
    writer.join()
    listed = store.list(JOURNAL)
    assert [f.content_name() for f in listed] == [frag.content_name()]
    assert _read_all(store, listed[0])[0] == frag.sum


def test_remove_is_idempotent(store_url: str, tmp_path: Path) -> None:
    store = FragmentStore(store_url)
    frag, path = _write_local(tmp_path, b"content")
    store.persist(frag, path)
    store.remove(frag)
    store.remove(frag)
    assert store.list(JOURNAL) == []


def test_store_for_caches_per_url(store_url: str) -> None:
    assert store_for(store_url) is store_for(store_url.rstrip("/"))
    assert store_for(store_url).store_url == store_url


def test_concurrent_readers_do_not_share_a_position(store_url: str, tmp_path: Path) -> None:
    store = FragmentStore(store_url)
    payload = os.urandom(3 * codecs.CHUNK_SIZE)
    frag, path = _write_local(tmp_path, payload)
    store.persist(frag, path)
    with store.open(frag) as a, store.open(frag) as b:
        got_a, got_b = bytearray(), bytearray()
        while True:
            chunk_a, chunk_b = a.read(100_000), b.read(100_000)
            got_a += chunk_a
            got_b += chunk_b
            if not chunk_a and not chunk_b:
                break
    assert got_a == payload and got_b == payload
