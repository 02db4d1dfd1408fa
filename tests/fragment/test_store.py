"""Fragment store conformance suite: every fsspec store must pass it (file://, memory://, and S3
through s3fs against a real local S3 server, moto's, on loopback).

A store's guarantee is that a fragment's name identifies and verifies its content: what a
reader opens is exactly the content the name's SHA1 covers, and no reader ever sees a part of it.
Then the store URLs themselves: malformed ones and ones whose fsspec backend cannot be loaded are
refused with one line saying what to do, before any I/O.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest

from tests.support.missing import hide_package
from tests.support.moto_s3 import MotoS3
from tidings.fragment import Fragment, FragmentStore, codecs, store_for
from tidings.fragment.store import check_store_url
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import ValidationError

JOURNAL = "examples/orders"
PAYLOAD_SIZE = 3 * 1024 * 1024 + 12345  # several chunks, not a chunk multiple


@pytest.fixture(params=["file", "memory", "s3"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "file":
        yield f"file://{tmp_path / 'store'}/"
    elif request.param == "s3":
        moto: MotoS3 = request.getfixturevalue("moto_s3")  # started only when an S3 case runs
        yield moto.url()  # a fresh prefix per test
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
    base, _, query = store.store_url.partition("?")
    assert store.url(frag) == f"{base}{JOURNAL}/{frag.content_name()}" + (f"?{query}" if query else "")
    if not query:  # a query holds the store's options (Gazette's), which fsspec.open does not read
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


def test_exists_follows_persist_and_remove_is_idempotent(store_url: str, tmp_path: Path) -> None:
    store = FragmentStore(store_url)
    frag, path = _write_local(tmp_path, b"content")
    assert not store.exists(frag)
    store.persist(frag, path)
    assert store.exists(frag)
    store.remove(frag)
    assert not store.exists(frag)
    store.remove(frag)
    assert store.list(JOURNAL) == []


def test_store_for_caches_per_url(store_url: str) -> None:
    base, sep, query = store_url.partition("?")
    assert store_for(store_url) is store_for(base.rstrip("/") + sep + query)
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


def test_s3_endpoint_from_the_aws_environment(moto_s3: MotoS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain s3:// URL reaches the endpoint the AWS SDKs read from AWS_ENDPOINT_URL_S3, as any AWS tool would."""
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_s3.endpoint)
    store = FragmentStore(f"s3://{moto_s3.bucket}/env-{uuid.uuid4().hex[:8]}/")
    frag, path = _write_local(tmp_path, os.urandom(5000))
    store.persist(frag, path)
    assert [f.content_name() for f in store.list(JOURNAL)] == [frag.content_name()]
    with fsspec.open(store.url(frag), "rb") as f:  # a query-less URL is fetchable by fsspec as-is
        assert f.read() == open(path, "rb").read()


@pytest.mark.parametrize(
    "url,needle",
    [
        pytest.param("bucket/prefix/", "not a URL", id="no-scheme"),
        pytest.param("/var/tidings/fragments/", "not a URL", id="bare-path"),
        pytest.param("file:relative/", "not a URL", id="no-slashes"),
        pytest.param("file://data/fragments/", "file:///absolute/path/", id="relative-file-path"),
        pytest.param("s3:///prefix/", "names no bucket", id="no-bucket"),
        pytest.param("s3://bucket/p/?endpont=http://127.0.0.1:9", "unknown option 'endpont'", id="misspelt-option"),
        pytest.param("file:///tmp/x/?endpoint=http://127.0.0.1:9", "take no options", id="option-on-file"),
        pytest.param("nosuchfs://bucket/", "fsspec has no protocol 'nosuchfs'", id="unknown-protocol"),
    ],
)
def test_bad_store_url_is_refused_in_one_line(url: str, needle: str) -> None:
    with pytest.raises(ValidationError) as exc:
        check_store_url(url, "spec.fragment.stores[0]")
    msg = str(exc.value)
    assert msg.startswith(f"spec.fragment.stores[0]: fragment store {url!r}: ") and needle in msg, msg
    assert "\n" not in msg
    with pytest.raises(ValidationError, match="fragment store"):
        store_for(url)  # the same refusal, not an error from deep inside fsspec


def test_store_url_path_must_be_a_folder() -> None:
    with pytest.raises(ValidationError, match=r"'s3://bucket/prefix': the path must end in '/'"):
        check_store_url("s3://bucket/prefix")
    assert store_for("memory://folder").store_url == "memory://folder/", "store_for makes it one"


@pytest.mark.parametrize(
    "url",
    [
        "file:///var/tidings/fragments/",
        "memory://demo/",
        "s3://bucket/",
        "s3://bucket/a/prefix/?endpoint=http://127.0.0.1:9000&region=eu-west-1&profile=minio",
    ],
)
def test_good_store_url_passes_without_io(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_network(*args: object) -> None:
        raise AssertionError(f"network I/O while checking {url}: {args}")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    check_store_url(url)


def test_store_whose_backend_is_not_installed_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hide_package(monkeypatch, tmp_path, "s3fs", protocols=("s3", "s3a"))
    expected = (
        "fragment store 's3://bucket/prefix/': fsspec cannot load protocol 's3' (No module named 's3fs'); "
        "install it with pip install 'tidings[s3]'"
    )
    with pytest.raises(ValidationError) as exc:
        check_store_url("s3://bucket/prefix/")
    assert str(exc.value) == expected
    with pytest.raises(ValidationError) as exc:
        store_for("s3://bucket/prefix/")
    assert str(exc.value) == expected
