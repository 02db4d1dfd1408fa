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

Store URLs and their backends (choices where the issue is silent):
- A URL is checked before any I/O (`check_store_url`): its shape (`validate.store_url`: scheme,
  bucket, absolute file path, trailing '/'), its options, and that this process can load the
  scheme's fsspec backend. `journals apply` (in the CLI and in the broker's Apply) refuses a store
  that fails it, with one line naming the URL and what to install, rather than a journal that
  hangs later; `store_for` raises the same error instead of an ImportError from deep in fsspec.
  Any protocol fsspec can load is accepted; file://, memory:// and s3:// are the tested ones.
- `s3://` needs s3fs: `pip install 'tidings[s3]'`. Credentials come from the AWS SDKs' usual chain
  (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws, instance roles), and so may
  the endpoint and region (AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, AWS_REGION: botocore, under
  s3fs, reads them), as for any AWS tool on the machine.
- As in Gazette, an S3 store URL may carry its options in its query, which then travel with the
  journal spec and each fragment's backing_store to every broker and to clients that read fragments
  straight from the store: `s3://bucket/prefix/?endpoint=http://127.0.0.1:9000&region=eu-west-1&profile=minio`
  (Gazette's S3StoreQueryArgs names). `endpoint` also switches to path-style addressing, as Gazette
  does, which S3-compatible servers (MinIO, moto) need. Other options, and options on other
  schemes, are refused rather than ignored. The query is part of the store's identity.
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
from urllib.parse import parse_qsl, urlsplit

import fsspec
from fsspec import AbstractFileSystem

from tidings.fragment import codecs
from tidings.fragment.fragment import Fragment, parse_content_name
from tidings.protocol import validate
from tidings.protocol.status import ValidationError

log = logging.getLogger(__name__)

# Protocols whose writes become visible atomically at close (an object PUT or a completed multipart upload).
_ATOMIC_PUT_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl"})


# Options a store URL's query may carry, per protocol (Gazette's S3 store query arguments).
_S3_OPTIONS = ("endpoint", "profile", "region")
_URL_OPTIONS: dict[str, tuple[str, ...]] = {"s3": _S3_OPTIONS, "s3a": _S3_OPTIONS}

# What to install when fsspec knows a protocol but cannot import its backend.
_INSTALL = {
    "s3": "pip install 'tidings[s3]'",
    "s3a": "pip install 'tidings[s3]'",
    "gs": "pip install gcsfs",
    "gcs": "pip install gcsfs",
    "az": "pip install adlfs",
    "abfs": "pip install adlfs",
    "abfss": "pip install adlfs",
    "adl": "pip install adlfs",
}


def _normalise(url: str) -> str:
    """`url` with a trailing '/' on its path (before any query)."""
    base, sep, query = url.partition("?")
    return (base if base.endswith("/") else base + "/") + sep + query


def _url_options(url: str, ctx: str) -> dict[str, str]:
    """The options in `url`'s query, refusing any its protocol does not take."""
    parts = urlsplit(url)
    allowed = _URL_OPTIONS.get(parts.scheme, ())
    options: dict[str, str] = {}
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if not allowed:
            raise ValidationError(
                ctx, f"fragment store {url!r}: {parts.scheme}:// stores take no options (got {key!r})"
            )
        if key not in allowed:
            raise ValidationError(
                ctx,
                f"fragment store {url!r}: unknown option {key!r}; {parts.scheme}:// stores take {', '.join(allowed)}",
            )
        if not value or key in options:
            raise ValidationError(ctx, f"fragment store {url!r}: option {key!r} must be given once, with a value")
        options[key] = value
    return options


def _storage_options(protocol: str, options: dict[str, str]) -> dict[str, Any]:
    """fsspec storage options for a store URL's own options (s3fs's, for S3)."""
    out: dict[str, Any] = {}
    if protocol in ("s3", "s3a"):
        if "endpoint" in options:
            out["endpoint_url"] = options["endpoint"]
            out["config_kwargs"] = {"s3": {"addressing_style": "path"}}  # bucket-named hosts need real S3's DNS
        if "region" in options:
            out["client_kwargs"] = {"region_name": options["region"]}
        if "profile" in options:
            out["profile"] = options["profile"]
    return out


def _load_backend(url: str, protocol: str, ctx: str) -> None:
    """Import the fsspec class of `protocol` (no I/O), or say in one line what is missing."""
    what = f"fragment store {url!r}"
    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:  # fsspec's "Protocol not known"
        raise ValidationError(
            ctx,
            f"{what}: fsspec has no protocol {protocol!r}; use file://, s3://, gs://, az:// or memory://, "
            f"or install the fsspec package for {protocol}://",
        ) from None
    except Exception as exc:
        # fsspec raises ImportError(its own hint) from the import's own error: report the import's.
        cause = exc.__cause__ if isinstance(exc, ImportError) and exc.__cause__ is not None else exc
        why = str(cause) if isinstance(cause, ImportError) else f"{type(cause).__name__}: {cause}"
        if protocol in _INSTALL:
            todo = f"install it with {_INSTALL[protocol]}"
        elif cause is not exc:
            todo = str(exc)  # fsspec's own hint, e.g. "Install sshfs to access SFTP"
        else:
            todo = "check that its package is installed and imports"
        raise ValidationError(ctx, f"{what}: fsspec cannot load protocol {protocol!r} ({why}); {todo}") from None


def check_store_url(url: str, ctx: str = "") -> None:
    """Raise ValidationError, one line naming `url` and what to do, unless this process can use the store.

    Checks the URL's shape, its options, and that fsspec can load the protocol's backend (an import,
    no network or file I/O). `ctx` is the dotted path of the field it came from, if any.
    """
    validate.store_url(url, ctx)
    _url_options(url, ctx)
    _load_backend(url, urlsplit(url).scheme, ctx)


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
    - `url`: an fsspec URL of a folder, maybe with options in its query (see the module docstring);
      a trailing "/" is added to its path if missing. Raises ValidationError, before any I/O, for a
      URL `check_store_url` refuses.
    - `storage_options`: passed to fsspec over the URL's own options (credentials, endpoint_url...).

    `store_url` is the normalised URL: the `backing_store` of every fragment this store returns.
    """

    def __init__(self, url: str, **storage_options: Any) -> None:
        self.store_url = _normalise(url)
        check_store_url(self.store_url)
        base, _, query = self.store_url.partition("?")
        self._base = base
        self._query = f"?{query}" if query else ""
        options = _storage_options(urlsplit(base).scheme, _url_options(self.store_url, ""))
        fs, root = fsspec.core.url_to_fs(base, **{**options, **storage_options})
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
        """The full URL of the fragment's file in this store (with the store's options, if any, as its query)."""
        return f"{self._base}{fragment.content_path()}{self._query}"

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
            codecs.compress_stream(src, buf, fragment.codec)  # type: ignore[arg-type]  # reads as a file, no BinaryIO
            src.check(fragment, local_name)
            self.fs.pipe_file(target, buf.getvalue())
            return
        folder = posixpath.dirname(target)
        write_to = target if self._atomic_put else f"{folder}/.{fragment.content_name()}.{uuid.uuid4().hex[:12]}.tmp"
        self.fs.makedirs(folder, exist_ok=True)
        dst = self.fs.open(write_to, "wb")
        try:
            src = _VerifyingReader(raw, fragment.content_length)
            codecs.compress_stream(src, dst, fragment.codec)  # type: ignore[arg-type]  # reads as a file, no BinaryIO
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
    """The shared FragmentStore of `url` (threads call this too, hence the lock).

    Raises ValidationError, naming the URL and what to install, for a store this process cannot use.
    """
    key = _normalise(url)
    with _stores_lock:
        store = _stores.get(key)
        if store is None:
            store = _stores[key] = FragmentStore(key)
        return store
