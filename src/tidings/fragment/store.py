"""FragmentStore: persisted fragments in a blob store reached through fsspec.

One store per URL (``file:///abs/path/``, ``memory://name/``, ``s3://bucket/prefix/``...); a
journal's fragments live in ``{url}{journal}/`` under their content names. Every method blocks
(network and file I/O, compression), so code on the event loop calls them via `asyncio.to_thread`.

Guarantees:
- A reader never sees a partial file. Filesystems (file://) get the compressed bytes under a
  hidden temporary name in the same folder, then a rename; object stores (s3, gs, az) publish an
  object only when its upload completes, so they are written in place. memory:// registers a
  file when it is opened for writing and hands every reader the same shared file object, so
  there the content is built privately and published in one step, and each open gets a copy
  (the store is for tests and demos: its content is in memory anyway).
- `persist` verifies the local content against the fragment's length and SHA1 while streaming,
  so a name in the store never lies about its content.
- Re-persisting is a no-op: the same name means the same content.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import io
import logging
import posixpath
import threading
import uuid
from typing import Any, BinaryIO

import fsspec
from fsspec import AbstractFileSystem

from tidings.fragment import codecs
from tidings.fragment.fragment import Fragment, parse_content_name
from tidings.protocol.status import ValidationError

log = logging.getLogger(__name__)

# Protocols whose writes become visible atomically at close (an object PUT or a completed multipart upload).
_ATOMIC_PUT_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl"})


class _VerifyingReader:
    """Reads exactly `length` bytes of a local spool file, hashing them as they pass.

    A spool file may hold uncommitted bytes past the fragment's end; they are never read.
    """

    def __init__(self, src: BinaryIO, length: int) -> None:
        self._src = src
        self._remaining = length
        self._sha1 = hashlib.sha1()

    def read(self, size: int = -1) -> bytes:
        if self._remaining <= 0:
            return b""
        n = self._remaining if size is None or size < 0 else min(size, self._remaining)
        data = self._src.read(n)
        self._remaining -= len(data)
        self._sha1.update(data)
        return data

    def check(self, fragment: Fragment, local_path: str) -> None:
        """Raise ValidationError unless the bytes read were exactly the fragment's content."""
        if self._remaining > 0:
            raise ValidationError(
                f"fragment {fragment.content_path()}",
                f"local file {local_path} is {self._remaining} bytes short of the fragment's {fragment.content_length}",
            )
        if self._sha1.digest() != fragment.sum:
            raise ValidationError(
                f"fragment {fragment.content_path()}",
                f"local file {local_path} has SHA1 {self._sha1.hexdigest()}, not the fragment's {fragment.sum.hex()}",
            )


def _mod_time(info: dict[str, Any]) -> int:
    """Unix seconds of a listing entry; each fsspec backend spells it differently."""
    for key in ("mtime", "LastModified", "last_modified", "updated", "created", "creation_time"):
        value = info.get(key)
        if value is None:
            continue
        if isinstance(value, dt.datetime):
            return int(value.timestamp())
        if isinstance(value, int | float):
            return int(value)
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                return int(dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp())
    return 0


class FragmentStore:
    """The fragments persisted under one store URL.

    **Parameters:**
    - `url`: an fsspec URL of a folder; a trailing "/" is added if missing.
    - `storage_options`: passed to fsspec (credentials, endpoint_url for a local S3...).

    `store_url` is the normalised URL: the `backing_store` of every fragment this store returns.
    """

    def __init__(self, url: str, **storage_options: Any) -> None:
        self.store_url = url if url.endswith("/") else url + "/"
        fs, root = fsspec.core.url_to_fs(self.store_url, **storage_options)
        self.fs: AbstractFileSystem = fs
        self._root = root.rstrip("/")
        protocols = fs.protocol if isinstance(fs.protocol, tuple | list) else (fs.protocol,)
        self._atomic_put = any(p in _ATOMIC_PUT_PROTOCOLS for p in protocols)
        self._in_memory = "memory" in protocols

    def __repr__(self) -> str:
        return f"FragmentStore({self.store_url!r})"

    def _dir(self, journal: str) -> str:
        return f"{self._root}/{journal}" if self._root else journal

    def _path(self, fragment: Fragment) -> str:
        return f"{self._dir(fragment.journal)}/{fragment.content_name()}"

    def url(self, fragment: Fragment) -> str:
        """The full URL a reader could fetch directly (the fragment's file in this store)."""
        return f"{self.store_url}{fragment.content_path()}"

    def list(self, journal: str) -> list[Fragment]:
        """Every valid fragment file of `journal`, with backing_store and mod_time set.

        Unparseable names are logged and skipped; hidden names (in-flight temporaries) are
        skipped quietly; a journal with no folder yet has no fragments.
        """
        folder = self._dir(journal)
        self.fs.invalidate_cache(folder)  # object stores cache listings; a refresh must be fresh
        try:
            entries = self.fs.ls(folder, detail=True)
        except FileNotFoundError:
            return []
        out: list[Fragment] = []
        for info in entries:
            if info.get("type") == "directory":
                continue  # a child journal's folder ("a" holds "a/b/")
            name = posixpath.basename(str(info["name"]).rstrip("/"))
            if name.startswith("."):
                continue
            try:
                out.append(parse_content_name(journal, name, self.store_url, _mod_time(info)))
            except ValidationError as err:
                log.warning("skipping %s%s/%s: %s", self.store_url, journal, name, err)
        out.sort(key=lambda f: (f.begin, f.end))
        return out

    def exists(self, fragment: Fragment) -> bool:
        """Whether the fragment's file is in the store (a fresh look, not a cached listing)."""
        path = self._path(fragment)
        self.fs.invalidate_cache(posixpath.dirname(path))
        return bool(self.fs.exists(path))

    def persist(self, fragment: Fragment, local: str | BinaryIO) -> Fragment:
        """Compress the local raw content of `fragment` into this store; returns it with backing_store set.

        `local` is a file path or a readable binary file positioned at the fragment's first byte
        (left open for the caller to close); bytes past content_length are ignored. Raises
        ValidationError, leaving nothing in the store, if the content does not match the
        fragment's length and SHA1.
        """
        persisted = fragment.with_store(self.store_url)
        if self.exists(fragment):
            return persisted
        if isinstance(local, str):
            with open(local, "rb") as raw:
                self._persist(fragment, raw, local)
        else:
            self._persist(fragment, local, getattr(local, "name", "<spool file>"))
        return persisted

    def _persist(self, fragment: Fragment, raw: BinaryIO, local_name: str) -> None:
        target = self._path(fragment)
        if self._in_memory:
            buf = io.BytesIO()
            src = _VerifyingReader(raw, fragment.content_length)
            codecs.compress_stream(src, buf, fragment.codec)  # type: ignore[arg-type]
            src.check(fragment, local_name)
            self.fs.pipe_file(target, buf.getvalue())
            return
        folder = posixpath.dirname(target)
        write_to = target if self._atomic_put else f"{folder}/.{fragment.content_name()}.{uuid.uuid4().hex[:12]}.tmp"
        self.fs.makedirs(folder, exist_ok=True)
        dst = self.fs.open(write_to, "wb")
        try:
            src = _VerifyingReader(raw, fragment.content_length)
            codecs.compress_stream(src, dst, fragment.codec)  # type: ignore[arg-type]
            src.check(fragment, local_name)  # before close(), which is what publishes
            dst.close()
        except BaseException:
            self._abandon(dst, write_to, target)
            raise
        if write_to != target:
            try:
                self.fs.mv(write_to, target)
            except BaseException:
                with contextlib.suppress(Exception):
                    self.fs.rm(write_to)
                raise

    def _abandon(self, dst: Any, write_to: str, target: str) -> None:
        """Drop a failed write without publishing it.

        fsspec files publish on close(), even on an error, so an in-place (object store) upload is
        discarded and marked closed instead; a temporary file is closed and removed.
        """
        if write_to == target:
            with contextlib.suppress(Exception):
                dst.discard()  # s3fs aborts the multipart upload
            with contextlib.suppress(Exception):
                dst.closed = True  # so neither close() nor __del__ uploads the partial buffer
            return
        with contextlib.suppress(Exception):
            dst.close()
        with contextlib.suppress(Exception):
            self.fs.rm(write_to)

    def open(self, fragment: Fragment) -> BinaryIO:
        """A streaming reader of the decompressed content; closing it closes the store file."""
        path = self._path(fragment)
        src = io.BytesIO(self.fs.cat_file(path)) if self._in_memory else self.fs.open(path, "rb")
        try:
            return codecs.decompress_reader(src, fragment.codec)
        except BaseException:
            src.close()
            raise

    def remove(self, fragment: Fragment) -> None:
        """Delete the fragment's file (retention); an already missing file is not an error."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._path(fragment))


_stores: dict[str, FragmentStore] = {}
_stores_lock = threading.Lock()


def store_for(url: str) -> FragmentStore:
    """The shared FragmentStore of `url` (threads call this too, hence the lock)."""
    key = url if url.endswith("/") else url + "/"
    with _stores_lock:
        store = _stores.get(key)
        if store is None:
            store = _stores[key] = FragmentStore(key)
        return store
